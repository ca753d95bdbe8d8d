"""The agent-loop benchmark runs and prints its JSON line (figures are not asserted: see the benchmark)."""

import json

import pytest

from benchmarks import agent_loop

pytestmark = pytest.mark.timeout(120)


def test_benchmark_prints_its_json_line(capsys):
    assert agent_loop.main(["--episodes", "50", "--turns", "3", "--repeats", "1", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"per_turn_us", "bare_per_turn_us", "ratio", "episodes", "peak_rss_mb"} <= set(figures)
    assert figures["episodes"] == 50 and figures["per_turn_us"] > 0 and figures["bare_per_turn_us"] > 0
