"""A short ``psrl train`` of the quickstart recipe: the resolved config in the run directory,
rollout samples that ``psrl runs show`` renders, the new metrics, and ``trainer.export_hf=true``
writing the same model that ``psrl export`` makes from the checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from psrl.testing.sim_tasks import write_digit_task

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart" / "config.yaml"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_short_quickstart_run_writes_config_samples_metrics_and_hf_export(tmp_path):
    from psrl.models import model_dir

    train, val = write_digit_task(tmp_path / "data", train=32, val=4)
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable, "-m", "psrl.cli", "train", str(QUICKSTART), f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"logging.output_dir={run}", f"trainer.checkpoint_dir={ckpt}", "logging.progress_bar=false", "trainer.total_steps=3", "trainer.mode=sync",
        "trainer.eval_every=0", "trainer.save_every=0", "data.batch_size=2", "gen_actor_rollout_ref.rollout.sampling.n=4",
        "gen_actor_rollout_ref.rollout.engine.cpu_kv_cache_gb=0.5", "logging.rollout_samples_every=1",
        "logging.rollout_samples_per_step=3", "trainer.export_hf=true",
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=560, cwd=REPO)
    assert out.returncode == 0, out.stderr[-4000:]

    # The resolved config, with the model as a directory, in the run dir and beside the checkpoints.
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["trainer"]["model_path"] == str(model_dir("tiny-qwen2")) and saved["logging"]["output_dir"] == str(run)
    assert (ckpt / "config.yaml").read_text() == (run / "config.yaml").read_text()

    # Rollout samples, by the policy version that generated them (sync: versions 0, 1 and 2).
    steps = sorted(int(p.stem[5:]) for p in (run / "rollouts").glob("step_*.jsonl"))
    assert steps == [0, 1, 2], steps
    rec = json.loads((run / "rollouts" / "step_0.jsonl").read_text().splitlines()[0])
    assert rec["turns"] and rec["prompt"] and "reward" in rec
    shown = subprocess.run([sys.executable, "-m", "psrl.cli", "runs", "show", str(run), "--step", "1"],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
    assert shown.returncode == 0 and "step 1" in shown.stdout and "turn 0: model" in shown.stdout, shown.stderr

    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if m["kind"] == "train"]
    assert all("train/zero_variance_groups" in m for m in train) and any(k.startswith("reward/") and k.endswith("/mean")
                                                                       and k != "reward/mean" for k in train[-1])

    # trainer.export_hf=true wrote run/hf; psrl export of the final checkpoint gives the same tensors.
    from safetensors.torch import load_file

    assert (run / "hf" / "model.safetensors").is_file() and (run / "hf" / "tokenizer_config.json").is_file()
    exp = subprocess.run([sys.executable, "-m", "psrl.cli", "export", str(ckpt), "-o", str(tmp_path / "hf2")],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert exp.returncode == 0, exp.stderr
    a, b = load_file(str(run / "hf" / "model.safetensors")), load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert set(a) == set(b) and all((a[k] == b[k]).all() for k in a)
    src = load_file(str(model_dir("tiny-qwen2") / "model.safetensors"))
    assert any(not (a[k] == src[k]).all() for k in a), "three trained steps should change the weights"
