"""``mini_swe_agent`` with the built-in bash agent: a scripted policy through the real gateway,
real bubblewrap sandboxes, grading in a fresh sandbox; limits; the rollout runner end to end."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
from transformers import AutoTokenizer

from psrl.agent_loops import AGENT_LOOPS
from psrl.agent_loops.base import EpisodeContext
from psrl.agent_loops.mini_swe import MiniSWEAgentLoopV1
from psrl.agent_loops.runner import RolloutRunner
from psrl.config import MultiTurnConfig, RolloutConfig, SandboxPoolConfig, SandboxSpec
from psrl.engines import SamplingParams
from psrl.environments import Task
from psrl.environments.swe import SUBMIT_MARKER, load_builtin
from psrl.environments.swe.agent_data import MiniSWEAgentData
from psrl.environments.swe.env import MiniSWEEnv
from psrl.sandboxes import SandboxPool
from psrl.testing import ScriptedEngine
from psrl.trajectory import Status

from ..gateway.helpers import reply_ids, tool_call_ids
from .solutions import SOLUTIONS

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


def hf_tokenizer():
    from psrl.models import model_dir

    return AutoTokenizer.from_pretrained(model_dir("tiny-qwen2"))


def _ctx(engine, *, env=None, max_turns: int = 8, timeout_s: float = 60.0, agent: str = "bash") -> EpisodeContext:
    return EpisodeContext(
        key="batch/0/0", group_id="batch/0", engine=engine, env=env or MiniSWEEnv(),
        agent_data=MiniSWEAgentData(hf_tokenizer(), agent=agent), sampling=SamplingParams(max_tokens=400),
        multi_turn=MultiTurnConfig(enable=True, max_turns=max_turns, episode_timeout_s=timeout_s),
    )


def _task(task_id: str) -> Task:
    return Task(prompt=load_builtin(task_id).issue, data_source="swe", extra_info={"swe_task": task_id})


def assert_trajectory_is_what_the_engine_saw(traj, engine) -> None:
    """Each call's prompt is the trajectory up to that turn; each turn is the engine's output."""
    seq = np.concatenate([traj.prompt_ids, traj.response_ids])
    assert len(engine.requests) == traj.num_turns
    for req, (start, end) in zip(engine.requests, traj.turn_bounds):
        np.testing.assert_array_equal(req.prompt_ids, seq[: len(traj.prompt_ids) + start])
        assert traj.loss_mask[start:end].all() and (traj.versions[start:end] == engine.version).all()
    assert traj.loss_mask.sum() == sum(e - s for s, e in traj.turn_bounds)


async def test_scripted_agent_solves_a_task_for_reward_1():
    engine = ScriptedEngine([
        tool_call_ids("cat textkit/slug.py"),
        tool_call_ids(SOLUTIONS["text_slugify"]),
        reply_ids(f"Fixed.\n```bash\necho {SUBMIT_MARKER}\n```"),  # a fenced block works too
    ])
    loop = AGENT_LOOPS.get("mini_swe_agent")()
    traj = await loop.run(_ctx(engine), _task("text_slugify"))
    assert (traj.status, traj.error, traj.reward) == (Status.OK, None, 1.0)
    assert traj.key == "batch/0/0" and traj.data_source == "swe"
    assert traj.env_metrics["tests_passed"] == 3 and traj.env_metrics["model_calls"] == 3
    assert traj.env_metrics["samples"] == 1 and traj.env_metrics["exit_Submitted"] == 1
    assert_trajectory_is_what_the_engine_saw(traj, engine)
    assert engine.requests[0].sampling.max_tokens == 400  # the episode's sampling, not the agent's


async def test_untouched_workspace_gets_reward_0():
    engine = ScriptedEngine([tool_call_ids("ls"), tool_call_ids(f"echo {SUBMIT_MARKER}")])
    traj = await MiniSWEAgentLoopV1().run(_ctx(engine), _task("calc_divide_by_zero"))
    assert (traj.status, traj.reward, traj.env_metrics["tests_passed"]) == (Status.OK, 0.0, 0)
    assert_trajectory_is_what_the_engine_saw(traj, engine)


async def test_turn_limit_ends_the_episode_truncated_and_still_graded():
    engine = ScriptedEngine([tool_call_ids(SOLUTIONS["stats_median"]), tool_call_ids("ls")])
    async with SandboxPool(SandboxSpec(), SandboxPoolConfig(warm=0)) as pool:
        traj = await MiniSWEAgentLoopV1().run(_ctx(engine, env=MiniSWEEnv(sandbox_pool=pool), max_turns=3), _task("stats_median"))
        assert pool.statistics().in_use == 0  # the sandbox was released
    assert traj.status == Status.TRUNCATED and "turn limit of 3" in traj.error
    assert traj.reward == 1.0  # the fix was made before the limit: grading still ran
    assert traj.num_turns == 3 and traj.env_metrics["turn_limit"] == 1


async def test_time_limit_ends_the_episode_truncated_and_releases_everything():
    engine = ScriptedEngine([tool_call_ids("ls")], delay_s=lambda req: 0.0 if len(engine.requests) < 2 else 60.0)
    async with SandboxPool(SandboxSpec(), SandboxPoolConfig(warm=0)) as pool:
        with anyio.fail_after(60):
            traj = await MiniSWEAgentLoopV1().run(
                _ctx(engine, env=MiniSWEEnv(sandbox_pool=pool), timeout_s=3.0), _task("stats_median")
            )
        assert pool.statistics().in_use == 0
    assert traj.status == Status.TRUNCATED and "time limit of 3 s" in traj.error
    assert traj.reward == 0.0 and traj.env_metrics["time_limit"] == 1
    assert traj.num_turns == 1  # the call cut off by the limit was never delivered, so not captured
    assert engine.statistics().requests_in_flight == 0


async def test_a_bad_task_fails_the_episode_with_the_reason():
    engine = ScriptedEngine([tool_call_ids("ls")])
    traj = await MiniSWEAgentLoopV1().run(_ctx(engine), Task(prompt="x", extra_info={"swe_task": "nope"}))
    assert traj.status == Status.FAILED and "env.reset raised TaskFormatError" in traj.error
    assert engine.requests == []


async def test_rollout_runner_runs_a_batch_of_swe_rows():
    tok = hf_tokenizer()
    cfg = RolloutConfig.model_validate({
        "sampling": {"n": 2, "max_tokens": 200},
        "multi_turn": {"enable": True, "max_turns": 4, "episode_timeout_s": 60},
        "agent": {
            "default_agent_loop": "mini_swe_agent", "env": {"name": "mini_swe_env"},
            "data": {"name": "mini_swe_agent_data", "kwargs": {"agent": "bash"}}, "on_failure": "keep_group",
        },
    })

    def script(req) -> list[int]:
        text = tok.decode(req.prompt_ids.tolist())
        turns = text.count("<|im_start|>assistant") - 1
        task_id = "calc_divide_by_zero" if "divide" in text else "text_slugify"
        plan = [SOLUTIONS[task_id], f"echo {SUBMIT_MARKER}"] if task_id == "text_slugify" else ["ls", f"echo {SUBMIT_MARKER}"]
        return tool_call_ids(plan[min(turns, 1)])

    engine = ScriptedEngine(script)
    rows = [load_builtin(t).to_row() for t in ("text_slugify", "calc_divide_by_zero")]
    async with SandboxPool(SandboxSpec(), SandboxPoolConfig(warm=2, max_concurrency=4)) as pool:
        runner = RolloutRunner(cfg, tokenizer=tok, sandbox_pool=pool)
        result = await runner.run_batch(rows, engine=engine, batch_id="b")
        assert pool.statistics().in_use == 0
    by_key = {t.key: t for t in result.trajectories}
    assert sorted(by_key) == ["b/0/0", "b/0/1", "b/1/0", "b/1/1"]
    assert [by_key[k].reward for k in sorted(by_key)] == [1.0, 1.0, 0.0, 0.0], [(k, t.env_metrics, t.error) for k, t in sorted(by_key.items())]
    assert all(t.status == Status.OK and t.num_turns == 2 for t in result.trajectories)
