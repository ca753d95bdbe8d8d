"""``psrl train`` of the quickstart with ``trainer.lora.rank=8`` in async mode: the engine serves
each version's adapter while requests are in flight across syncs (a request that reaches vLLM
just after a sync still finds the adapter it names), the engine and the trainer agree at the
first step, and ``psrl export`` of the checkpoint loads with peft (and ``--merge`` with
transformers) with the same log-probs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from psrl.testing.sim_tasks import write_digit_task

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart" / "config.yaml"


@pytest.mark.timeout(600)
def test_async_lora_run_serves_adapters_and_exports_for_peft(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from psrl.models import model_dir

    train, val = write_digit_task(tmp_path / "data", train=64, val=4)
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable, "-m", "psrl.cli", "train", str(QUICKSTART), f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"logging.output_dir={run}", f"trainer.checkpoint_dir={ckpt}", "logging.progress_bar=false", "trainer.total_steps=6",
        "trainer.mode=async", "trainer.eval_every=0", "trainer.save_every=6", "trainer.lora.rank=8",
        "gen_actor_rollout_ref.rollout.engine.cpu_kv_cache_gb=0.5",
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=560, cwd=REPO)
    assert out.returncode == 0, out.stderr[-4000:]
    train_rows = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if m["kind"] == "train"]
    assert len(train_rows) == 6 and all(m["train/update_ok"] == 1.0 for m in train_rows)
    assert train_rows[0]["train/rollout_logprob_abs_diff"] < 1e-5  # version 0: the base, nothing stale

    for args, name in (([], "adapter"), (["--merge"], "merged")):
        done = subprocess.run([sys.executable, "-m", "psrl.cli", "export", str(ckpt), "-o", str(tmp_path / name), *args],
                              env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
        assert done.returncode == 0, done.stderr[-2000:]
    base = str(model_dir("tiny-qwen2"))
    ids = torch.tensor([[5, 80, 13, 200, 7, 31]])
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(tmp_path / "adapter"))(ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))(ids).logits
        base_logits = AutoModelForCausalLM.from_pretrained(base)(ids).logits
    assert (peft_logits - merged_logits).abs().max() < 1e-4
    assert (peft_logits - base_logits).abs().max() > 1e-4  # the adapters trained
