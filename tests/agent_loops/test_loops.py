"""Each loop against the scripted engine: exact token layouts, masks, versions and turn bounds,
and every way an episode can end (done, max_turns, budget, engine error, env crash, timeout)."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from psrl.agent_loops import AGENT_LOOPS, EpisodeContext
from psrl.agent_loops.generate_only import GenerateOnlyAgentLoop
from psrl.agent_loops.multi_turn import MultiTurnAgentLoop, MultiTurnCompletionAgentLoop
from psrl.config import MultiTurnConfig
from psrl.engines import SamplingParams
from psrl.environments import Task
from psrl.testing import (
    ByteAgentData,
    CrashingEnv,
    EchoEnv,
    GuessNumberEnv,
    ScriptedEngine,
)
from psrl.trajectory import NO_VERSION, Status

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

B = ByteAgentData()
enc = B.encode


def ctx(engine, env, data=None, **mt):
    multi = MultiTurnConfig(**{"enable": True, "max_turns": 8, **mt})
    return EpisodeContext(
        key="k0", group_id="g0", engine=engine, env=env, agent_data=data or ByteAgentData(prefix="\n> ", suffix="\n"),
        sampling=SamplingParams(max_tokens=32), multi_turn=multi,
    )


def test_registered_names():
    assert AGENT_LOOPS.get("generate_only_agent") is GenerateOnlyAgentLoop
    assert AGENT_LOOPS.get("multi_turn_agent") is MultiTurnAgentLoop
    assert AGENT_LOOPS.get("multi_turn_completion_agent") is MultiTurnCompletionAgentLoop
    assert MultiTurnCompletionAgentLoop.observation_mode == "completion" and MultiTurnAgentLoop.observation_mode == "chat"


async def test_generate_only_exact_trajectory():
    engine = ScriptedEngine([enc("it is 42")], logprob=-0.25)
    await engine.update_weights([], version=3)
    traj = await GenerateOnlyAgentLoop().run(ctx(engine, EchoEnv()), Task(prompt="say 42", ground_truth="42", data_source="echo"))
    np.testing.assert_array_equal(traj.prompt_ids, enc("say 42"))
    np.testing.assert_array_equal(traj.response_ids, enc("it is 42"))
    assert traj.loss_mask.tolist() == [1] * 8 and traj.versions.tolist() == [3] * 8
    assert np.all(traj.logprobs == np.float32(-0.25))
    assert traj.turn_bounds.tolist() == [[0, 8]] and traj.turn_rewards.tolist() == [1.0]
    assert (traj.reward, traj.status, traj.error, traj.data_source, traj.key, traj.group_id) == (1.0, Status.OK, None, "echo", "k0", "g0")
    traj.validate()


async def test_multi_turn_exact_layout_and_token_in_token_out():
    engine = ScriptedEngine([enc("5"), enc("8"), enc("7")])
    traj = await MultiTurnAgentLoop().run(ctx(engine, GuessNumberEnv()), Task(prompt="guess", ground_truth=7))
    obs1, obs2 = enc("\n> higher\n"), enc("\n> lower\n")
    expected = np.concatenate([enc("5"), obs1, enc("8"), obs2, enc("7")])
    np.testing.assert_array_equal(traj.response_ids, expected)
    assert traj.loss_mask.tolist() == [1] + [0] * len(obs1) + [1] + [0] * len(obs2) + [1]
    assert traj.versions.tolist() == [0] + [NO_VERSION] * len(obs1) + [0] + [NO_VERSION] * len(obs2) + [0]
    assert np.all(traj.logprobs[traj.loss_mask == 0] == 0)
    a, b = 1 + len(obs1), 2 + len(obs1) + len(obs2)
    assert traj.turn_bounds.tolist() == [[0, 1], [a, a + 1], [b, b + 1]]
    assert traj.turn_rewards.tolist() == [0.0, 0.0, 1.0] and traj.reward == 1.0 and traj.status is Status.OK
    # Each request is exactly the previous context plus the model's tokens plus the observation.
    prompts = [r.prompt_ids for r in engine.requests]
    np.testing.assert_array_equal(prompts[0], enc("guess"))
    np.testing.assert_array_equal(prompts[1], np.concatenate([enc("guess"), expected[:a]]))
    np.testing.assert_array_equal(prompts[2], np.concatenate([enc("guess"), expected[:b]]))
    assert {r.session_id for r in engine.requests} == {"k0"}  # sticky routing per episode


async def test_max_turns_truncates_without_the_unused_observation():
    engine = ScriptedEngine([enc("1")])
    traj = await MultiTurnAgentLoop().run(ctx(engine, GuessNumberEnv(), max_turns=3), Task(prompt="g", ground_truth=9))
    assert traj.status is Status.TRUNCATED and traj.num_turns == 3 and traj.error is None
    assert traj.response_ids[-1] == enc("1")[0] and traj.loss_mask[-1] == 1  # ends on the model's turn
    assert len(engine.requests) == 3


async def test_response_budget_caps_max_tokens_and_truncates():
    engine = ScriptedEngine([enc("1111111111")])  # 10 tokens a turn
    traj = await MultiTurnAgentLoop().run(ctx(engine, GuessNumberEnv(), max_response_length=30), Task(prompt="g", ground_truth=9))
    obs = len(enc("\n> lower\n"))
    # Turn 1: 10 tokens + the observation; turn 2 may take only what is left of the 30.
    assert [r.sampling.max_tokens for r in engine.requests] == [30, 30 - 10 - obs]
    assert traj.status is Status.TRUNCATED and len(traj.response_ids) <= 30


async def test_multi_turn_needs_enable():
    traj = await MultiTurnAgentLoop().run(ctx(ScriptedEngine([enc("1")]), env := GuessNumberEnv(), enable=False), Task(prompt="g", ground_truth=1))
    assert traj.status is Status.FAILED and "multi_turn.enable=true" in traj.error and env.closed


async def test_engine_error_fails_the_episode_with_its_message():
    engine = ScriptedEngine([enc("x")], vocab_size=50)  # the prompt's bytes are outside [0, 50)
    env = GuessNumberEnv()
    traj = await MultiTurnAgentLoop().run(ctx(engine, env), Task(prompt="guess", ground_truth=1))
    assert traj.status is Status.FAILED and "engine error on turn 1" in traj.error and "outside" in traj.error
    assert env.closed and len(traj.prompt_ids) == 5


@pytest.mark.parametrize("where", ["reset", "step"])
async def test_env_crash_fails_the_episode_and_closes_the_env(where):
    env = CrashingEnv(crash_on=where, message="kaboom")
    traj = await MultiTurnAgentLoop().run(ctx(ScriptedEngine([enc("1")]), env), Task(prompt="p"))
    assert traj.status is Status.FAILED and f"env.{where} raised RuntimeError: kaboom" == traj.error
    assert env.closed
    traj.validate()


async def test_codec_crash_is_recorded():
    class BadData(ByteAgentData):
        def tokens_to_action(self, output_ids):
            raise ValueError("cannot parse")

    traj = await MultiTurnAgentLoop().run(ctx(ScriptedEngine([enc("1")]), GuessNumberEnv(), BadData()), Task(prompt="p", ground_truth=1))
    assert traj.error == "agent_data.tokens_to_action raised ValueError: cannot parse" and traj.num_turns == 1


async def test_episode_timeout_fails_and_aborts_the_request():
    engine = ScriptedEngine([enc("1")], delay_s=lambda req: 0.0 if len(engine.requests) == 1 else 60.0)
    env = GuessNumberEnv()
    with anyio.fail_after(10):
        traj = await MultiTurnAgentLoop().run(ctx(engine, env, episode_timeout_s=0.3), Task(prompt="p", ground_truth=9))
    assert traj.status is Status.FAILED and "timed out after 0.3 s (in engine.generate)" in traj.error
    assert traj.num_turns == 1 and env.closed and engine.statistics().requests_in_flight == 0


async def test_prompt_over_the_limit_fails_before_generating():
    engine = ScriptedEngine([enc("1")])
    c = ctx(engine, GuessNumberEnv())
    c.max_prompt_length = 3
    traj = await MultiTurnAgentLoop().run(c, Task(prompt="a long prompt", ground_truth=1))
    assert traj.status is Status.FAILED and "13 tokens, more than the limit of 3" in traj.error and not engine.requests


async def test_cancellation_propagates_after_closing_the_env():
    engine = ScriptedEngine([enc("1")], delay_s=60.0)
    env = GuessNumberEnv()
    with anyio.move_on_after(0.2):
        await MultiTurnAgentLoop().run(ctx(engine, env), Task(prompt="p", ground_truth=9))
        pytest.fail("the loop swallowed the cancellation")
    assert env.closed and engine.statistics().requests_in_flight == 0
