"""The queue benchmark runs end to end and prints its JSON line (tiny sizes; slow: it starts
several queues of service processes)."""

import json

import pytest

from benchmarks.queue import main


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_queue_prints_its_json_line(capsys):
    assert main(["--n", "64", "--tokens", "128", "--chunk", "32", "--rounds", "3", "--meta-batches", "4",
                 "--rss-samples", "20000", "--no-peer", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("ipc_gbps", "tcp_gbps", "raw_ipc_gbps", "raw_tcp_gbps", "ratio", "tcp_ratio", "get_meta_p50_ms",
                "get_meta_p99_ms", "controller_rss_mb_1m"):
        assert out[key] > 0, key
        if key.endswith("gbps"):
            assert out[key] >= out[f"{key}_median"] > 0, key  # best of the rounds, then their median
    for key in ("ipc", "raw_ipc", "tcp", "raw_tcp"):  # tiny rounds may fit in one clock tick: >= 0
        assert out[f"{key}_cpu_ms_per_round"] >= 0, key
    assert out["ratio"] == pytest.approx(out["ipc_gbps"] / out["raw_ipc_gbps"], rel=1e-2)
    assert out["get_meta_held_samples"] == 4 * 1024
    assert out["transferqueue_tcp_gbps"] is None and out["vs_transferqueue"] is None
    assert len(out["loadavg_start"]) == 3
