"""A row's ``env_kwargs`` (dict column, or a JSON object string) merged over the config's
``env.kwargs``: per row, never cached across rows, bad values named."""

from __future__ import annotations

import pytest

from psrl.agent_loops.registry import resolve_components
from psrl.agent_loops.runner import RolloutRunner
from psrl.config import RolloutConfig
from psrl.environments.dataset import DatasetError, check_row, load_rows, merge_env_kwargs, write_rows
from psrl.testing import ByteAgentData, ScriptedEngine
from psrl.trajectory import Status

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def config() -> RolloutConfig:
    return RolloutConfig.model_validate({
        "sampling": {"n": 1, "max_tokens": 8},
        "multi_turn": {"enable": True, "max_turns": 6},
        "agent": {
            "default_agent_loop": "multi_turn_agent",
            "env": {"name": "psrl.testing.GuessNumberEnv", "kwargs": {"max_guesses": 4}},
            "data": {"name": "psrl.testing.ByteAgentData"},
        },
    })


def test_merge_rules():
    assert merge_env_kwargs({"a": 1, "b": 2}, {"env_kwargs": {"b": 3, "c": None}}) == {"a": 1, "b": 3}
    assert merge_env_kwargs({"a": 1}, {"env_kwargs": '{"a": 5}'}) == {"a": 5}
    assert merge_env_kwargs({"a": 1}, {}) == {"a": 1}
    agent = config().agent
    assert resolve_components({"env_kwargs": {"max_guesses": 2}}, agent).env_kwargs == {"max_guesses": 2}
    # another env class: the config's kwargs do not apply, the row's do
    comp = resolve_components({"env_class": "psrl.testing.EchoEnv", "env_kwargs": {"x": 1}}, agent)
    assert comp.env_kwargs == {"x": 1}


@pytest.mark.parametrize(("value", "message"), [([1], "must be a mapping"), ("{not json", "not JSON"), ({1: 2}, "string keys")])
def test_bad_env_kwargs_are_named(value, message):
    with pytest.raises(DatasetError, match=f"data.jsonl row 3: column 'env_kwargs'.*{message}|{message}"):
        check_row({"prompt": "p", "env_kwargs": value}, "data.jsonl row 3")


def test_parquet_round_trip_with_struct_nulls(tmp_path):
    rows = [{"prompt": "p", "env_kwargs": {"seed": 1}}, {"prompt": "q", "env_kwargs": {"opponent": "x"}}]
    loaded = load_rows(write_rows(tmp_path / "r.parquet", rows))
    # parquet unifies the struct: each row gets the other's key as null, which means "not set"
    assert [r["env_kwargs"] for r in loaded] == [{"seed": 1}, {"opponent": "x"}]


async def test_each_row_gets_its_own_kwargs():
    engine = ScriptedEngine(lambda req: ByteAgentData().encode("1"))  # always a wrong guess
    rows = [
        {"prompt": "g", "reward_model": {"ground_truth": 7}, "env_kwargs": {"max_guesses": 1}},
        {"prompt": "g", "reward_model": {"ground_truth": 7}, "env_kwargs": {"max_guesses": 3}},
        {"prompt": "g", "reward_model": {"ground_truth": 7}},
    ]
    result = await RolloutRunner(config()).run_batch(rows, engine=engine, batch_id="b")
    turns = {t.group_id: t.num_turns for t in result.trajectories}
    assert turns == {"b/0": 1, "b/1": 3, "b/2": 4}
    assert all(t.status is Status.OK for t in result.trajectories)
