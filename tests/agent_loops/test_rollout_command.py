"""``psrl rollout``: a dataset in, trajectories in parquet out, with a summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from psrl.config import ConfigError, load_config
from psrl.environments.dataset import write_rows
from psrl.pipeline.rollout import print_summary, rollout
from psrl.testing import ScriptedEngine
from psrl.trajectory import Status, from_arrow

pytestmark = pytest.mark.timeout(120)


def _call(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "code_interpreter", "arguments": {"code": code}}) + "</tool_call>"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from psrl.models import model_dir

    return AutoTokenizer.from_pretrained(model_dir("tiny-qwen2"))


def _config(tmp_path, data, **extra):
    overrides = [
        f"data.train_files=[{data}]", "data.batch_size=2",
        "gen_actor_rollout_ref.rollout.sampling.n=2",
        "gen_actor_rollout_ref.rollout.multi_turn.enable=true",
        "gen_actor_rollout_ref.rollout.agent.default_agent_loop=multi_turn_agent",
        f"sandbox.spec.state_dir={tmp_path / 'sb'}", "sandbox.pool.warm=0", "logging.progress_bar=false",
        *[f"{k}={v}" for k, v in extra.items()],
    ]
    return load_config(None, overrides)


@pytest.mark.anyio
async def test_rollout_writes_parquet_and_summarizes(tmp_path, tokenizer):
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "reward_model": {"ground_truth": str(2 * i)}} for i in range(3)]
    rows.append({**rows[0], "env_class": "psrl.testing.CrashingEnv"})
    data = write_rows(tmp_path / "rows.jsonl", rows)
    # Turn 1 runs python (plus one malformed call), turn 2 answers: right for rows 0 and 1 only.
    answers = {0: "0", 1: "2", 2: "5"}
    turns: dict[str, int] = {}

    def script(req):
        row = 2 * int(req.session_id[1]) + int(req.session_id.split("/")[1])  # "b{batch}/{row}/{j}"
        turns[req.session_id] = turns.get(req.session_id, 0) + 1
        if turns[req.session_id] == 1:
            return tokenizer.encode(_call("print(1 + 1)") + "<tool_call>{bad}</tool_call>") + [tokenizer.eos_token_id]
        return tokenizer.encode(f"\\boxed{{{answers.get(row, '0')}}}") + [tokenizer.eos_token_id]

    out = tmp_path / "out" / "traj.parquet"
    summary = await rollout(_config(tmp_path, data), str(out), engine=ScriptedEngine(script), tokenizer=tokenizer)
    kept = from_arrow(pq.read_table(out))
    dropped = from_arrow(pq.read_table(tmp_path / "out" / "traj.dropped.parquet"))
    assert len(kept) == 6 and {t.group_id for t in kept} == {"b0/0", "b0/1", "b1/0"}
    assert len(dropped) == 2 and all(t.status is Status.FAILED and "environment crashed" in t.error for t in dropped)
    assert [t.reward for t in sorted(kept, key=lambda t: t.key)] == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert all(t.num_turns == 2 and t.env_metrics["tool_errors"] == 1.0 for t in kept)
    assert (summary.episodes, summary.written, summary.dropped, summary.failed) == (8, 6, 2, 2)
    assert summary.reward_mean == pytest.approx(4 / 8) and summary.turns_mean == pytest.approx(14 / 8)  # crashed ones: 1 turn
    assert (summary.tool_calls, summary.tool_errors) == (12.0, 6.0)
    assert summary.generated_tokens == sum(int(t.loss_mask.sum()) for t in kept + dropped) and summary.tokens_per_s > 0
    assert not list((tmp_path / "sb").glob("sb-*"))


def test_summary_prints(tmp_path, capsys):
    from psrl.pipeline.rollout import RolloutSummary

    print_summary(RolloutSummary("x.parquet", 8, 6, 2, 2, 1, 0.5, 1.5, 12.0, 6.0, 100, 2.0, 50.0))
    out = capsys.readouterr().out
    assert "reward mean" in out and "0.5000" in out and "tokens/s" in out and "12 / 6" in out


@pytest.mark.anyio
async def test_setup_errors_are_config_errors(tmp_path, tokenizer):
    with pytest.raises(ConfigError, match="data.train_files"):
        await rollout(load_config(None, []), str(tmp_path / "o.parquet"), engine=ScriptedEngine([[1]]), tokenizer=tokenizer)
    (tmp_path / "bad.jsonl").write_text('{"no_prompt": 1}\n')
    with pytest.raises(ConfigError, match="bad.jsonl row 0: column 'prompt'"):
        await rollout(_config(tmp_path, tmp_path / "bad.jsonl"), str(tmp_path / "o.parquet"), engine=ScriptedEngine([[1]]), tokenizer=tokenizer)
    data = write_rows(tmp_path / "ok.jsonl", [{"prompt": "q"}])
    cfg = _config(tmp_path, data, **{"gen_actor_rollout_ref.rollout.multi_turn.enable": "false"})
    with pytest.raises(ConfigError, match="multi_turn.enable=true"):
        await rollout(cfg, str(tmp_path / "o.parquet"), engine=ScriptedEngine([[1]]), tokenizer=tokenizer)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_psrl_rollout_retool_recipe_with_smollm2(tmp_path):
    """The ReTool recipe on this machine: real vLLM with SmolLM2, real bubblewrap, via the CLI."""
    out = tmp_path / "retool.parquet"
    cmd = [
        sys.executable, "-m", "psrl.cli", "rollout", "-o", str(out), "recipes/retool/config.yaml",
        "data.max_samples=4", "data.batch_size=4", "gen_actor_rollout_ref.rollout.sampling.n=2",
        "gen_actor_rollout_ref.rollout.sampling.max_tokens=96", "gen_actor_rollout_ref.rollout.multi_turn.max_turns=3",
        "gen_actor_rollout_ref.rollout.engine.max_model_len=2048", f"sandbox.spec.state_dir={tmp_path / 'sb'}",
        "logging.progress_bar=false",
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=840, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "reward mean" in proc.stdout and "tokens/s" in proc.stdout
    dropped = tmp_path / "retool.dropped.parquet"
    trajs = from_arrow(pq.read_table(out)) if out.exists() else []
    trajs += from_arrow(pq.read_table(dropped)) if dropped.exists() else []
    assert len(trajs) == 8
    for t in trajs:
        t.validate()
        assert t.status is not Status.FAILED, t.error
        assert t.loss_mask.sum() > 0 and (t.logprobs[t.loss_mask == 1] <= 0).all()
