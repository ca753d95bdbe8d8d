"""``textarena_env`` against the real TextArena package: TicTacToe vs fixed opponents."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

pytest.importorskip("textarena", reason="needs the envs extra (textarena)")

from psrl.environments import Task  # noqa: E402
from psrl.environments.dataset import write_rows  # noqa: E402
from psrl.environments.textarena_env.env import TextArenaEnv  # noqa: E402
from psrl.environments.textarena_env.opponents import listed_moves, make_opponent  # noqa: E402
from psrl.pipeline.rollout import rollout  # noqa: E402
from psrl.testing import ScriptedEngine, check_environment  # noqa: E402
from psrl.trajectory import Status, from_arrow  # noqa: E402

from .adapters_common import reply, rollout_config, tiny_tokenizer  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]
TASK = Task(prompt="play")


async def _play(env: TextArenaEnv, moves: list[str]) -> list[tuple]:
    obs, _ = await env.reset(TASK)
    trace = [obs.messages[0]["content"]]
    for move in moves:
        obs, reward, done, info = await env.step(move)
        trace.append((reward, done, info["metrics"]))
        if done:
            break
    await env.aclose()
    return trace


async def test_policy_wins_against_first_valid_opponent():
    # first_valid answers 4 with 0, 2 with 1; then 6 completes the 2-4-6 diagonal.
    trace = await _play(TextArenaEnv(opponent="first_valid"), ["[4]", "[2]", "[6]"])
    assert "Tic Tac Toe" in trace[0] and "Available Moves" in trace[0]
    assert [t[:2] for t in trace[1:]] == [(0.0, False), (0.0, False), (1.0, True)]
    assert trace[-1][2]["win"] == 1.0


async def test_policy_loses_against_a_scripted_opponent_and_invalid_moves_are_counted():
    env = TextArenaEnv(opponent=["[0]", "[1]", "[2]"])
    obs, _ = await env.reset(TASK)
    obs, reward, done, info = await env.step("I will think about it")  # not a move
    assert info["metrics"]["invalid_moves"] == 1.0 and not done and "invalid move" in obs.messages[0]["content"]
    assert "[Player 0]" not in obs.messages[0]["content"]  # the model's own move is not echoed back
    for move in ["[4]", "[8]", "[3]"]:
        obs, reward, done, info = await env.step(move)
        assert done or "[Player 1]" in obs.messages[0]["content"]
    assert (reward, done) == (-1.0, True)  # the opponent completed 0-1-2
    await env.aclose()


async def test_conformance():
    await check_environment(lambda: TextArenaEnv(seed=7), TASK, ["[4]", "[0]", "[8]", "[2]", "[6]"], bad_actions=["", "[99]", "\x00" * 50])


def test_opponents():
    assert listed_moves("board\nAvailable Moves: '[0]', '[5]'") == ["[0]", "[5]"]
    with pytest.raises(ValueError, match="unknown opponent"):
        make_opponent("nobody")
    import random

    with pytest.raises(ValueError, match="no listed moves"):
        make_opponent("random_valid")("no moves here", random.Random(0))


async def test_unknown_game_names_the_registry():
    with pytest.raises(ValueError, match="ENV_REGISTRY"):
        await TextArenaEnv(env_id="NoSuchGame-v0").reset(TASK)


async def test_game_through_psrl_rollout(tmp_path):
    tokenizer = tiny_tokenizer()
    rows = [{"prompt": "play", "env_class": "textarena_env", "env_kwargs": {"env_id": "TicTacToe-v0", "opponent": "first_valid", "seed": 1}}]
    data = write_rows(tmp_path / "rows.jsonl", rows)
    turns: dict[str, int] = {}

    def script(req):
        turns[req.session_id] = turns.get(req.session_id, 0) + 1
        return reply(tokenizer, ["[4]", "[2]", "[6]"][turns[req.session_id] - 1])

    cfg = rollout_config(tmp_path, data, n=2, max_turns=5)
    out = tmp_path / "out.parquet"
    await rollout(cfg, str(out), engine=ScriptedEngine(script), tokenizer=tokenizer)
    trajs = from_arrow(pq.read_table(out))
    assert len(trajs) == 2
    for t in trajs:
        assert t.status is Status.OK and t.num_turns == 3 and t.reward == 1.0 and t.env_metrics["win"] == 1.0
        # between turns the model saw the opponent's move as a user message
        obs_text = tokenizer.decode(t.response_ids[t.turn_bounds[0][1]:t.turn_bounds[1][0]].tolist())
        assert "[Player 1] [0]" in obs_text
