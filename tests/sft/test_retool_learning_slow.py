"""The ReTool cold start learns (slow tier): SmolLM2-135M makes no well-formed tool call and
solves nothing on held-out ReTool rows; after the recipe's SFT (6 steps of 8 sequences) on 48 procedurally generated
demonstrations it calls the Python tool in the right format and answers correctly part of the
time. Every stage is the real command: demos through bubblewrap, Megatron SFT, vLLM rollouts.
Fixed seeds; greedy evaluation. Reliability: see README (ReTool section)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .cli import psrl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

EVAL_ROWS = 16


def _evaluate(model: str, out: Path, sandbox: Path) -> dict:
    from psrl.sft.stats import trajectory_stats

    psrl("eval", "recipes/retool/config.yaml", "--model", model, "-o", str(out), "--data", "recipes/retool/data/val.jsonl",
         "--limit", str(EVAL_ROWS), f"logging.output_dir={out}", "*.rollout.multi_turn.episode_timeout_s=3600", "logging.progress_bar=false",
         f"sandbox.spec.state_dir={sandbox}", "sandbox.pool.warm=0", timeout=1200)
    return trajectory_stats(out / "samples.parquet")


def test_retool_cold_start_raises_accuracy_and_well_formed_calls(tmp_path):
    sb = tmp_path / "sb"
    demos = tmp_path / "demos.parquet"
    psrl("data", "retool-demos", "-o", str(demos), "--rows", "48", "--seed", "0", f"sandbox.spec.state_dir={sb}", timeout=600)
    base = _evaluate("smollm2-135m", tmp_path / "base", sb)
    out = tmp_path / "sft"
    stdout = psrl("sft", "recipes/retool/sft.yaml", f"sft.data=[{demos}]", f"sft.save_dir={out}",
                  f"logging.output_dir={out}", "sft.seed=0", "trainer.seed=0", timeout=2400)
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["last_loss"] < 0.7 * summary["first_loss"] and summary["last_token_acc"] > summary["first_token_acc"]
    tuned = _evaluate(str(out / "hf"), tmp_path / "sft_eval", sb)
    print(json.dumps({"base": base, "sft": tuned}))
    assert base["well_formed_rate"] <= 0.1 and base["accuracy"] <= 0.1
    assert tuned["well_formed_rate"] >= 0.5, tuned
    assert tuned["accuracy"] >= base["accuracy"] + 0.25, tuned
