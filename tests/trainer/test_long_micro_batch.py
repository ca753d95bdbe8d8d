"""An 8,192-token micro-batch of SmolLM2-135M trains on CPU within a stated memory bound.

Measured in a fresh process (peak RSS above the level with model, gradient buffers and Adam state
built), with ``trainer.recompute=full``. Measured 4.9 GB on the shared 2-core machine: the
(tokens x vocabulary) logits and their gradient are 3.2 GB of it; a dense (T, T) attention mask
and score matrix alone would add 9 heads x 8,192^2 x 4 B = 2.4 GB per layer.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from psrl.models import model_dir

BOUND_GB = 6.5
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_8192_token_micro_batch_trains_within_memory_bound():
    cmd = [sys.executable, "-m", "benchmarks.trainer_throughput", "--mem-probe", str(model_dir("smollm2-135m")), "8192", "cpu", "full"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=1700)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["micro_batches"] == 1.0  # the 8,192 tokens were one micro-batch
    assert math.isfinite(res["loss"]) and math.isfinite(res["grad_norm"]) and res["grad_norm"] > 0
    assert res["growth_gb"] < BOUND_GB, f"an 8,192-token step took {res['growth_gb']:.2f} GB above the pre-step level"
