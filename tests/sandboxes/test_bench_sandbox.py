"""``psrl bench sandbox``: the arms run interleaved in ABBA order, and the benchmark runs end to
end on real bubblewrap with no leaks."""

from __future__ import annotations

import json

import anyio
import pytest

from benchmarks import sandbox as bench

pytestmark = pytest.mark.timeout(120)


def test_arms_alternate_in_abba_order():
    calls: list[str] = []

    def arm(name):
        async def cycle() -> None:
            calls.append(name)
        return cycle

    out = anyio.run(bench.interleaved, {"a": arm("a"), "b": arm("b")}, {"a": 2, "b": 1}, 4)
    assert calls[:2] == ["a", "b"]  # one warm-up cycle each, untimed
    assert calls[2:] == [
        "a", "a", "b",  # round 0: forward
        "b", "a", "a",  # round 1: reversed
        "a", "a", "b",  # round 2: forward
        "b", "a", "a",  # round 3: reversed
    ]
    assert [len(r) for r in out["a"]] == [2, 2, 2, 2] and [len(r) for r in out["b"]] == [1, 1, 1, 1]


def test_benchmark_runs_interleaved_and_leaks_nothing(capsys):
    code = bench.main(["--samples", "6", "--rounds", "3", "--cycles", "12", "--docker-cycles", "0", "--json"])
    out = capsys.readouterr().out
    res = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and res["leaks"] == 0 and res["rounds"] == 3
    for arm in ("sh", "bubblewrap"):
        assert 0 < res[f"{arm}_best_round_median_ms"] <= res[f"{arm}_median_round_median_ms"]
    assert res["bubblewrap_median_ms"] > res["sh_median_ms"]  # a sandbox costs more than a bare shell
    assert "interleaved rounds (ABBA)" in out


def test_fewer_than_three_rounds_is_refused():
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "2"])
