"""The rollout runner: GRPO groups, per-row component overrides, failure policy, concurrency cap,
and a cancelled batch that leaves no sandbox and no engine request behind."""

from __future__ import annotations

import functools
import json

import anyio
import numpy as np
import pytest

from psrl.agent_loops.runner import RolloutRunner, apply_failure_policy
from psrl.config import RolloutConfig, SandboxPoolConfig, SandboxSpec
from psrl.environments import Task
from psrl.sandboxes import SandboxPool
from psrl.testing import ByteAgentData, GuessNumberEnv, ScriptedEngine
from psrl.trajectory import Status

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

enc = ByteAgentData().encode


def config(**agent) -> RolloutConfig:
    return RolloutConfig.model_validate({
        "sampling": {"n": 2, "max_tokens": 16},
        "multi_turn": {"enable": True, "max_turns": 4},
        "agent": {
            "default_agent_loop": "multi_turn_agent",
            "env": {"name": "psrl.testing.GuessNumberEnv", "kwargs": {"max_guesses": 3}},
            "data": {"name": "psrl.testing.ByteAgentData", "kwargs": {"prefix": "|"}},
            **agent,
        },
    })


async def test_groups_keys_and_per_row_overrides():
    engine = ScriptedEngine(lambda req: enc("5"))
    rows = [
        {"prompt": "guess", "reward_model": {"ground_truth": 5}},  # config defaults
        {"prompt": "say 5", "reward_model": {"ground_truth": "5"}, "agent_name": "generate_only_agent", "env_class": "psrl.testing.EchoEnv"},
        # The same class under another name: an override, so the config's data kwargs do not apply.
        {"prompt": "guess", "reward_model": {"ground_truth": 9}, "data_class": "psrl.testing.toy_envs.ByteAgentData"},
    ]
    result = await RolloutRunner(config()).run_batch(rows, engine=engine, batch_id="b7")
    by_group = {}
    for t in result.trajectories:
        by_group.setdefault(t.group_id, []).append(t)
    assert sorted(by_group) == ["b7/0", "b7/1", "b7/2"] and not result.dropped
    assert sorted(t.key for t in by_group["b7/0"]) == ["b7/0/0", "b7/0/1"]
    assert all(t.reward == 1.0 and t.num_turns == 1 for t in by_group["b7/0"] + by_group["b7/1"])
    # Row 3 swaps the codec: the config's data kwargs (prefix "|") do not carry over to it.
    t = by_group["b7/2"][0]
    assert t.status is Status.OK and t.num_turns == 3 and t.reward == 0.0  # max_guesses=3: the config's env kwargs
    obs = t.response_ids[t.loss_mask == 0]
    assert bytes(obs.astype(np.uint8)).decode() == "higherhigher"
    guesses = [r for r in engine.requests if r.session_id.startswith("b7/0/")]
    assert bytes(guesses[0].prompt_ids.astype(np.uint8)).decode() == "guess"


class GuessFromText(GuessNumberEnv):
    """GuessNumberEnv for a codec whose actions are parsed turns (tool_agent_data)."""

    async def step(self, action):
        return await super().step(action.text)


async def test_row_override_of_codec_and_loop_mode(tmp_path):
    """The same env through the chat loop and the completion loop: only the observation tokens differ."""
    from transformers import AutoTokenizer

    from psrl.models import model_dir

    tok = AutoTokenizer.from_pretrained(model_dir("tiny-qwen2"))
    five = tok.encode("5") + [tok.eos_token_id]
    engine = ScriptedEngine(lambda req: five)
    row = {"prompt": [{"role": "user", "content": "guess"}], "reward_model": {"ground_truth": 6},
           "data_class": "tool_agent_data", "env_class": f"{__name__}.GuessFromText"}
    rows = [row, {**row, "agent_name": "multi_turn_completion_agent"}]
    runner = RolloutRunner(config(), tokenizer=tok)
    result = await runner.run_batch(rows, engine=engine, n=1)
    chat, completion = sorted(result.trajectories, key=lambda t: t.group_id)
    first_obs = lambda t: tok.decode(t.response_ids[t.turn_bounds[0, 1] : t.turn_bounds[1, 0]].tolist())
    assert first_obs(chat) == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    assert first_obs(completion) == "\nhigher\n"
    assert chat.num_turns == completion.num_turns == 4 and chat.status is completion.status is Status.TRUNCATED


async def test_bad_rows_fail_their_own_group_only():
    engine = ScriptedEngine(lambda req: enc("5"))
    rows = [
        {"prompt": "guess", "reward_model": {"ground_truth": 5}},
        {"prompt": "guess", "env_class": "no_such_env"},
        {"no_prompt": True},
        {"prompt": "guess", "env_class": "psrl.testing.CrashingEnv"},
    ]
    result = await RolloutRunner(config(on_failure="drop_group")).run_batch(rows, engine=engine)
    assert [t.group_id for t in result.trajectories] == ["batch/0", "batch/0"]
    errors = {t.group_id: t.error for t in result.dropped}
    assert "unknown environment 'no_such_env'" in errors["batch/1"]
    assert "column 'prompt'" in errors["batch/2"]
    assert errors["batch/3"] == "env.step raised RuntimeError: environment crashed"
    assert len(result.dropped) == 6 and len(result.failed) == 6

    kept = await RolloutRunner(config(on_failure="keep_group")).run_batch(rows, engine=engine)
    assert len(kept.trajectories) == 8 and not kept.dropped


def test_failure_policy_keeps_a_group_whole():
    from psrl.trajectory import Trajectory

    ok = Trajectory.from_steps("a/0", "a", [], [])
    bad = Trajectory.from_steps("a/1", "a", [], [], status=Status.FAILED, error="x")
    assert apply_failure_policy([[ok, bad]], "drop_group").dropped == [ok, bad]
    assert apply_failure_policy([[ok, bad]], "keep_group").trajectories == [ok, bad]
    with pytest.raises(ValueError, match="keep_group or drop_group"):
        apply_failure_policy([], "ignore")


def test_default_multi_turn_loop_needs_enable():
    cfg = config()
    cfg.multi_turn.enable = False
    with pytest.raises(ValueError, match=r"gen_actor_rollout_ref.rollout.multi_turn.enable=true"):
        RolloutRunner(cfg)


async def test_seeds_differ_within_a_group():
    cfg = config()
    cfg.sampling.seed = 1234
    engine = ScriptedEngine(lambda req: enc("5"))
    await RolloutRunner(cfg).run_batch([{"prompt": "guess", "reward_model": {"ground_truth": 5}}], engine=engine)
    seeds = [r.sampling.seed for r in engine.requests]
    assert len(set(seeds)) == 2 and all(s is not None for s in seeds)


class CountingEnv:
    live = peak = 0

    async def reset(self, task: Task):
        CountingEnv.live += 1
        CountingEnv.peak = max(CountingEnv.peak, CountingEnv.live)
        return "go", {}

    async def step(self, action):
        return "", 0.0, True, {}

    async def aclose(self):
        CountingEnv.live -= 1


async def test_concurrency_cap():
    CountingEnv.live = CountingEnv.peak = 0
    engine = ScriptedEngine(lambda req: enc("1"), delay_s=0.01)
    cfg = config(max_concurrency=3, env={"name": f"{__name__}.CountingEnv"}, default_agent_loop="generate_only_agent")
    result = await RolloutRunner(cfg).run_batch([{"prompt": "x"}] * 5, engine=engine)
    assert len(result.trajectories) == 10 and CountingEnv.peak == 3 and CountingEnv.live == 0


def _tool_call(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "code_interpreter", "arguments": {"code": code}}) + "</tool_call>"


async def test_cancelling_a_batch_releases_every_sandbox_and_request(tmp_path):
    """Half the episodes hang in a tool call inside their sandbox, half in generation; cancel."""
    from transformers import AutoTokenizer

    from psrl.models import model_dir

    tok = AutoTokenizer.from_pretrained(model_dir("tiny-qwen2"))
    quick = tok.encode(_tool_call("print(1)")) + [tok.eos_token_id]
    stuck = tok.encode(_tool_call("import time\ntime.sleep(600)")) + [tok.eos_token_id]

    def script(req):
        return stuck if req.session_id.endswith("/0") else quick

    turns: dict[str, int] = {}

    def delay(req):  # the second turn of the "/1" episodes never comes back
        turns[req.session_id] = turns.get(req.session_id, 0) + 1
        return 600.0 if req.session_id.endswith("/1") and turns[req.session_id] > 1 else 0.0

    engine = ScriptedEngine(script, delay_s=delay)
    cfg = RolloutConfig.model_validate({
        "sampling": {"n": 2, "max_tokens": 64},
        "multi_turn": {"enable": True, "max_turns": 4, "episode_timeout_s": 600},
        "agent": {"default_agent_loop": "multi_turn_agent", "env": {"name": "tool_env", "kwargs": {"timeout_s": 600}}},
    })
    state = tmp_path / "sb"
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "reward_model": {"ground_truth": "1"}} for i in range(3)]
    async with SandboxPool(SandboxSpec(state_dir=str(state)), SandboxPoolConfig(warm=0)) as pool:
        runner = RolloutRunner(cfg, tokenizer=tok, sandbox_pool=pool)
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(runner.run_batch, rows, engine=engine))
            with anyio.fail_after(30):
                while not (pool.statistics().in_use == 6 and engine.statistics().requests_in_flight == 3):
                    await anyio.sleep(0.05)
                sleepers = _sandboxed_sleepers(state)
                while len(sleepers) < 3:
                    await anyio.sleep(0.05)
                    sleepers = _sandboxed_sleepers(state)
            tg.cancel_scope.cancel()
        assert pool.statistics().in_use == 0
        assert engine.statistics().requests_in_flight == 0
        assert not _alive(sleepers), "a sandboxed process outlived the cancelled batch"
    assert not list(state.glob("sb-*"))


def _sandboxed_sleepers(state) -> list[int]:
    """``python3 -`` processes (the tool's interpreter) under a bwrap of this test's state dir."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.info["cmdline"][:2] == ["python3", "-"] and any(str(state) in " ".join(a.cmdline()) for a in p.parents()):
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, TypeError):
            continue
    return out


def _alive(pids: list[int]) -> list[int]:
    import psutil

    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
