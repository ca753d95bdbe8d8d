"""``psrl bench engine`` runs its arms in ABBA order (the run itself needs vLLM: see the README)."""

from __future__ import annotations

import pytest

from benchmarks.engine import abba, main


def test_abba_order_gives_each_arm_each_slot_equally():
    order = abba(4)
    assert order == ["direct", "psrl", "psrl", "direct", "direct", "psrl", "psrl", "direct"]
    firsts = [order[i] for i in range(0, len(order), 2)]
    assert firsts.count("direct") == firsts.count("psrl") == 2


def test_fewer_than_three_rounds_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--rounds", "2"])
    assert "--rounds must be >= 3" in capsys.readouterr().err
