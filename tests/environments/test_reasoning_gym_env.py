"""``reasoning_gym_env`` and ``psrl data reasoning-gym`` against the real reasoning-gym package."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

pytest.importorskip("reasoning_gym", reason="needs the envs extra (reasoning-gym)")

from psrl.cli import main as psrl_main  # noqa: E402
from psrl.environments.dataset import load_rows, row_to_task, write_rows  # noqa: E402
from psrl.environments.reasoning_gym_env.data import make_rows  # noqa: E402
from psrl.environments.reasoning_gym_env.env import ReasoningGymEnv  # noqa: E402
from psrl.pipeline.rollout import rollout  # noqa: E402
from psrl.testing import ScriptedEngine, check_environment  # noqa: E402
from psrl.trajectory import Status, from_arrow  # noqa: E402

from .adapters_common import reply, rollout_config, tiny_tokenizer  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_psrl_data_writes_verl_rows(tmp_path, capsys):
    out = tmp_path / "train.parquet"
    assert psrl_main(["data", "reasoning-gym", "basic_arithmetic", "--size", "5", "--seed", "3", "-o", str(out), "--config", "max_terms=3"]) == 0
    assert "wrote 5 rows" in capsys.readouterr().out
    rows = load_rows(out)
    assert len(rows) == 5
    import reasoning_gym

    truth = reasoning_gym.create_dataset("basic_arithmetic", size=5, seed=3, max_terms=3)
    for i, row in enumerate(rows):
        assert row["prompt"][0]["role"] == "system" and row["prompt"][1]["content"] == truth[i]["question"]
        assert row["reward_model"]["ground_truth"] == truth[i]["answer"]
        assert row["env_class"] == "reasoning_gym_env" and row["data_source"] == "reasoning_gym/basic_arithmetic"
        assert row["env_kwargs"] == {"dataset": "basic_arithmetic", "seed": 3, "size": 5, "config": '{"max_terms": 3}', "index": i}


def test_psrl_data_errors_name_the_problem(tmp_path, capsys):
    assert psrl_main(["data", "reasoning-gym", "no_such_generator", "--size", "2", "-o", str(tmp_path / "x.parquet")]) == 2
    err = capsys.readouterr().err
    assert "no_such_generator" in err and "basic_arithmetic" in err  # the known names are listed
    assert psrl_main(["data", "reasoning-gym", "basic_arithmetic", "--size", "2", "-o", str(tmp_path / "x.parquet"), "--config", "oops"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


@pytest.mark.anyio
async def test_scorer_gives_the_reward():
    row = make_rows("basic_arithmetic", size=3, seed=1)[2]
    answer = row["reward_model"]["ground_truth"]
    env = ReasoningGymEnv(**row["env_kwargs"])
    obs, _ = await env.reset(row_to_task(row))
    assert obs.messages == row["prompt"]
    assert (await env.step(f"thinking... <answer>{answer}</answer>"))[1:3] == (1.0, True)
    await env.reset(row_to_task(row))
    _, reward, done, info = await env.step("<answer>12345678</answer>")
    assert (reward, done, info["metrics"]["format_errors"]) == (0.0, True, 0.0)
    await env.reset(row_to_task(row))
    _, reward, _, info = await env.step(answer)  # right number, but not in the asked format
    assert reward == 0.0 and info["metrics"]["format_errors"] == 1.0
    raw = ReasoningGymEnv(**row["env_kwargs"], answer_format="raw")
    await raw.reset(row_to_task(row))
    assert (await raw.step(f" {answer} "))[1] == 1.0
    last = ReasoningGymEnv(**row["env_kwargs"], answer_format="last_number")
    await last.reset(row_to_task(row))
    assert (await last.step(f"1 and 2 make... so it is {answer}."))[1] == 1.0
    await last.aclose()
    await env.aclose()
    await raw.aclose()


@pytest.mark.anyio
async def test_row_from_another_generator_config_is_refused():
    row = make_rows("basic_arithmetic", size=2, seed=1)[0]
    kwargs = {**row["env_kwargs"], "seed": 2}  # not the seed the row was made with
    with pytest.raises(ValueError, match="another reasoning-gym version or config"):
        await ReasoningGymEnv(**kwargs).reset(row_to_task(row))


@pytest.mark.anyio
async def test_conformance():
    row = make_rows("leg_counting", size=1, seed=0)[0]
    await check_environment(
        lambda: ReasoningGymEnv(**row["env_kwargs"]), row_to_task(row), [f"<answer>{row['reward_model']['ground_truth']}</answer>"],
        bad_actions=["", "<answer>", "\x00" * 100],
    )


@pytest.mark.anyio
async def test_episode_through_psrl_rollout(tmp_path):
    tokenizer = tiny_tokenizer()
    rows = make_rows("basic_arithmetic", size=3, seed=5)
    data = write_rows(tmp_path / "train.parquet", rows)
    answers = [r["reward_model"]["ground_truth"] for r in rows]

    def script(req):  # row 0 answered right, row 1 wrong, row 2 right by one episode in two
        _, row, j = req.session_id.split("/")
        good = int(row) == 0 or (int(row) == 2 and j == "0")
        return reply(tokenizer, f"<answer>{answers[int(row)] if good else 'x'}</answer>")

    cfg = rollout_config(tmp_path, data, n=2, max_turns=1, loop="generate_only_agent", **{"gen_actor_rollout_ref.rollout.multi_turn.enable": "false"})
    out = tmp_path / "out.parquet"
    summary = await rollout(cfg, str(out), engine=ScriptedEngine(script), tokenizer=tokenizer)
    trajs = {t.key: t for t in from_arrow(pq.read_table(out))}
    assert summary.episodes == 6 and all(t.status is Status.OK for t in trajs.values())
    assert {k: t.reward for k, t in trajs.items()} == {"b0/0/0": 1.0, "b0/0/1": 1.0, "b0/1/0": 0.0, "b0/1/1": 0.0, "b0/2/0": 1.0, "b0/2/1": 0.0}
    assert all(t.data_source == "reasoning_gym/basic_arithmetic" for t in trajs.values())
