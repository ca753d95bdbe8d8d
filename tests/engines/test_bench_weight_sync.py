"""The weight-sync benchmark runs end to end on the tiny model, the arms into a real vLLM engine
included, and prints its JSON line (slow: it starts a receiver process and a vLLM engine)."""

import json

import pytest

from benchmarks.weight_sync import main


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_weight_sync_prints_its_json_line(capsys):
    assert main(["--model", "tiny-qwen2", "--rounds", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["weight_sync_model"] == "tiny-qwen2" and out["weight_sync_rounds"] == 3
    assert out["weight_sync_export_buffers"] is True  # every timed shm sync sent the export buffers
    for key in ("weight_sync_s", "weight_sync_fs_s", "weight_sync_tcp_s", "weight_sync_gbps", "weight_sync_raw_tcp_gbps",
                "weight_sync_vllm_s", "weight_sync_vllm_fs_s"):
        assert out[key] > 0, key
    assert "weight_sync_vllm_error" not in out
    assert out["weight_sync_vs_fs"] == pytest.approx(out["weight_sync_s"] / out["weight_sync_fs_s"], rel=0.05, abs=0.02)  # of seconds rounded to 4 places
    assert out["weight_sync_vllm_vs_fs"] == pytest.approx(out["weight_sync_vllm_s"] / out["weight_sync_vllm_fs_s"], rel=0.05, abs=0.02)  # of seconds rounded to 4 places
