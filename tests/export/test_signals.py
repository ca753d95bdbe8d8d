"""Signals that show reward hacking: environment metrics per step and per data source,
zero-variance groups, and full rollouts as text written by the rollout side and rendered by
``psrl runs show``."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from psrl.agent_loops.registry import TOOL_PARSERS
from psrl.agent_loops.runner import RolloutRunner
from psrl.agent_loops.samples import RolloutSampleWriter
from psrl.config import RolloutConfig, SandboxPoolConfig, SandboxSpec
from psrl.pipeline import runs_show
from psrl.pipeline.metrics import METRIC_FIELDS, batch_metrics
from psrl.sandboxes import SandboxPool
from psrl.testing import ScriptedEngine
from psrl.trajectory import Step, Trajectory, to_arrow


def _traj(key, group, reward, source, metrics):
    step = Step(np.arange(3, dtype=np.int32), np.full(3, -0.5, np.float32), np.full(3, 4, np.int32), reward=reward, done=True)
    return Trajectory.from_steps(key, group, np.array([1, 2], np.int32), [step], env_metrics=metrics, data_source=source)


@pytest.mark.timeout(20)
def test_every_env_metric_per_step_and_per_data_source_and_zero_variance_groups():
    trajs = [
        _traj("a0", "a", 1.0, "swe", {"tests_passed": 3.0, "swe/suspect_patch": 1.0}),
        _traj("a1", "a", 1.0, "swe", {"tests_passed": 1.0, "swe/suspect_patch": 0.0}),
        _traj("b0", "b", 0.0, "math", {"format_errors": 2.0}),
        _traj("b1", "b", 1.0, "math", {"format_errors": 0.0, "tests_passed": float("nan")}),
        _traj("c0", "c", 0.0, "math", {}),
        _traj("c1", "c", 0.0, "math", {}),
    ]
    assert "data_source" in METRIC_FIELDS
    m = batch_metrics(to_arrow(trajs), version=4)
    assert m["env/tests_passed"] == 2.0  # mean over the samples that report it (the NaN left out)
    assert m["env/swe/tests_passed"] == 2.0 and m["env/swe/swe/suspect_patch"] == 0.5
    assert m["env/format_errors"] == 1.0 and m["env/math/format_errors"] == 1.0
    assert m["reward/swe/mean"] == 1.0 and m["reward/math/mean"] == 0.25
    assert m["train/zero_variance_groups"] == 2.0  # a (all 1) and c (all 0); b varies
    assert batch_metrics(to_arrow(trajs), version=4, prefix="val/")["val/zero_variance_groups"] == 2.0


def _tool_call(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "code_interpreter", "arguments": {"code": code}}) + "</tool_call>"


@pytest.mark.anyio
@pytest.mark.timeout(90)
async def test_rollout_side_writes_sampled_steps_as_text_and_runs_show_renders_them(tmp_path):
    from transformers import AutoTokenizer

    from psrl.models import model_dir

    tok = AutoTokenizer.from_pretrained(model_dir("tiny-qwen2"))
    call = tok.encode(_tool_call("print(6 * 7)")) + [tok.eos_token_id]
    answer = tok.encode("The answer is 42") + [tok.eos_token_id]
    engine = ScriptedEngine(lambda req: answer if "<tool_response>" in tok.decode(req.prompt_ids) else call)
    cfg = RolloutConfig.model_validate({
        "sampling": {"n": 2, "max_tokens": 64},
        "multi_turn": {"enable": True, "max_turns": 3},
        "agent": {"default_agent_loop": "multi_turn_agent", "env": {"name": "tool_env", "kwargs": {"reward": "contains_digit"}}},
    })
    writer = RolloutSampleWriter(tmp_path / "run" / "rollouts", every=2, per_step=3, tokenizer=tok, tool_parser=TOOL_PARSERS.get("hermes")())
    row = {"prompt": [{"role": "user", "content": "what is 6*7?"}], "data_source": "arith", "reward_model": {"ground_truth": "42"}}
    async with SandboxPool(SandboxSpec(), SandboxPoolConfig(warm=0)) as pool:
        runner = RolloutRunner(cfg, tokenizer=tok, sandbox_pool=pool, samples=writer)
        for version in (0, 1, 2):  # the policy version that generates: 0 and 2 are sampled steps
            engine.version = version
            await runner.run_group(row, group_id=f"g{version}", engine=engine)
            await runner.run_group(row, group_id=f"h{version}", engine=engine)
        await runner.run_group(row, group_id="v", engine=engine, validation=True)  # validation: not sampled
    files = sorted(p.name for p in (tmp_path / "run" / "rollouts").iterdir())
    assert files == ["step_0.jsonl", "step_2.jsonl"]
    recs = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / "step_2.jsonl").read_text().splitlines()]
    assert len(recs) == 3 and {r["group_id"] for r in recs} == {"g2", "h2"}  # per_step caps it
    r = recs[0]
    assert r["step"] == 2 and r["data_source"] == "arith" and r["reward"] == 1.0 and "what is 6*7?" in r["prompt"]
    assert r["env_metrics"]["tool_calls"] == 1.0
    first, last = r["turns"][0], r["turns"][-1]
    assert "<tool_call>" in first["model"] and first["tool_calls"][0]["name"] == "code_interpreter"
    assert first["tool_calls"][0]["arguments"] == {"code": "print(6 * 7)"}
    assert "42" in first["env"] and "tool_response" in first["env"]  # the tool's result, as the model saw it
    assert "The answer is 42" in last["model"]

    out = io.StringIO()
    args = SimpleNamespace(run_dir=str(tmp_path / "run"), step=None, limit=1, max_chars=4000)
    assert runs_show.run(args, file=out) == 0
    text = out.getvalue()
    assert "step 2" in text and "g2/0" in text and "code_interpreter" in text and "The answer is 42" in text
    # The CLI: a step without samples names the ones that exist.
    cmd = [sys.executable, "-m", "psrl.cli", "runs", "show", str(tmp_path / "run")]
    r = subprocess.run([*cmd, "--step", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "steps with samples: 0, 2" in r.stderr
    r = subprocess.run([*cmd, "--step", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "step 0" in r.stdout and "tool_response" in r.stdout
