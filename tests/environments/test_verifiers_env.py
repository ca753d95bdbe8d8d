"""``verifiers_env`` with a verifiers (v1) taskset defined locally, dataset in memory: its rubric
gives the reward, single- and multi-turn, also through ``psrl rollout``."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

pytest.importorskip("verifiers.v1", reason="needs the envs extra (verifiers)")

from psrl.environments import Task  # noqa: E402
from psrl.environments.dataset import write_rows  # noqa: E402
from psrl.environments.verifiers_env.env import VerifiersEnv  # noqa: E402
from psrl.pipeline.rollout import rollout  # noqa: E402
from psrl.testing import ScriptedEngine, check_environment  # noqa: E402
from psrl.trajectory import Status, from_arrow  # noqa: E402

from .adapters_common import reply, rollout_config, tiny_tokenizer  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]
TASKSET = "tests.environments.vf_arith_taskset:ArithTaskset"
USER = "tests.environments.vf_arith_taskset:try_again"
NO_TASK = Task(prompt="(from the taskset)")


@pytest.fixture
def anyio_backend():
    return "asyncio"  # verifiers scores with asyncio.gather


async def test_single_turn_rubric_reward():
    env = VerifiersEnv(taskset=TASKSET, index=2)
    obs, _ = await env.reset(NO_TASK)
    assert obs.messages == [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 6 * 7?"}]
    _, reward, done, info = await env.step("It is 42")
    assert (reward, done) == (1.0, True)
    assert info["metrics"] == {"vf_model_turns": 1.0, "vf_reward_correct": 1.0}
    await env.reset(NO_TASK)
    assert (await env.step("41"))[1:3] == (0.0, True)
    await env.aclose()


async def test_multi_turn_user_and_stop_hook():
    env = VerifiersEnv(taskset=TASKSET, index=0, user=USER)
    await env.reset(NO_TASK)
    obs, reward, done, _ = await env.step("4")
    assert not done and obs.messages == [{"role": "user", "content": "That is not right, try again."}]
    _, reward, done, info = await env.step("5")  # the task's @vf.stop ends the exchange
    assert (reward, done, info["metrics"]["vf_model_turns"]) == (1.0, True, 2.0)
    await env.reset(NO_TASK)
    for turn in range(3):
        _, reward, done, info = await env.step("0")
    assert (reward, done, info["metrics"]["vf_model_turns"]) == (0.0, True, 3.0)  # the user gave up
    await env.aclose()


async def test_conformance_and_errors():
    await check_environment(lambda: VerifiersEnv(taskset=TASKSET, index=1, user=USER), NO_TASK, ["1", "2", "3"], bad_actions=["", "\x00"])
    with pytest.raises(ValueError, match="is not a task"):
        await VerifiersEnv(taskset=TASKSET, index=9).reset(NO_TASK)
    with pytest.raises(ValueError, match="taskset 'no_such_taskset_pkg'"):
        await VerifiersEnv(taskset="no_such_taskset_pkg", index=0).reset(NO_TASK)


async def test_episodes_through_psrl_rollout(tmp_path):
    tokenizer = tiny_tokenizer()
    rows = [
        {"prompt": "-", "env_class": "verifiers_env", "env_kwargs": {"taskset": TASKSET, "index": i, "user": USER}}
        for i in range(3)
    ]
    data = write_rows(tmp_path / "rows.jsonl", rows)
    turns: dict[str, int] = {}

    def script(req):  # wrong first; then row 0 gets it right, the others never do
        turns[req.session_id] = turns.get(req.session_id, 0) + 1
        row = int(req.session_id.split("/")[1])
        return reply(tokenizer, "5" if (row == 0 and turns[req.session_id] == 2) else "0")

    cfg = rollout_config(tmp_path, data, n=2, max_turns=5)
    out = tmp_path / "out.parquet"
    await rollout(cfg, str(out), engine=ScriptedEngine(script), tokenizer=tokenizer)
    trajs = {t.key: t for t in from_arrow(pq.read_table(out))}
    assert all(t.status is Status.OK for t in trajs.values()), [t.error for t in trajs.values()]
    assert {k: (t.reward, t.num_turns) for k, t in trajs.items()} == {
        "b0/0/0": (1.0, 2), "b0/0/1": (1.0, 2), "b0/1/0": (0.0, 3), "b0/1/1": (0.0, 3), "b0/2/0": (0.0, 3), "b0/2/1": (0.0, 3),
    }
    # the system prompt comes from the taskset, rendered by the policy's chat template
    assert "Answer with a number." in tokenizer.decode(trajs["b0/0/0"].prompt_ids.tolist())
