"""Rollout workers as Ray actors on a private local cluster: each runs its groups against the
engine actors through its own Router and writes them into the transfer queue itself; the driver
gets reports. A worker killed mid-group loses no group and duplicates none: its groups are
issued again and a replacement starts. The engine is the scripted one (in its own actor, as a
vLLM replica would be) so that the test takes seconds."""

from __future__ import annotations

import anyio
import pytest

from psrl.config import TransferQueueConfig
from psrl.config.rollout import RolloutConfig
from psrl.config.sandbox import SandboxConfig
from psrl.config.schema import ActorResources, RayConfig
from psrl.pipeline.protocols import QueueingGroupRollout
from psrl.pipeline.ray.common import ray_cluster, resolve
from psrl.pipeline.ray.engine import EngineActor
from psrl.pipeline.ray.rollout_worker import WorkerSpec
from psrl.pipeline.ray.worker_pool import RayRolloutWorkers
from psrl.pipeline.tq_queue import TransferQueueGroups, queue_config
from psrl.testing import ByteAgentData, ScriptedEngine
from psrl.transfer_queue import start_transfer_queue

pytestmark = pytest.mark.anyio
GROUPS, N = 6, 2


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def ray_local():
    with ray_cluster(RayConfig(address="local", num_cpus=2)):
        yield


class ScriptedEngineActor(EngineActor):
    """An engine replica's actor serving the scripted engine (always answers "5")."""

    async def start_scripted(self, delay_s: float):
        self.engine = ScriptedEngine(lambda req: ByteAgentData().encode("5"), delay_s=delay_s)
        self.engine.is_alive = lambda: True
        return self.engine.statistics()

    async def update_weights_packed(self, blob: bytes, version: int):
        await self.engine.update_weights([], version)
        return self.engine.statistics()


def _rollout() -> RolloutConfig:
    return RolloutConfig.model_validate({
        "sampling": {"n": N, "max_tokens": 8},
        "multi_turn": {"enable": True, "max_turns": 2},
        "agent": {
            "default_agent_loop": "multi_turn_agent",
            "env": {"name": "psrl.testing.GuessNumberEnv", "kwargs": {"max_guesses": 2}},
            "data": {"name": "psrl.testing.ByteAgentData"},
        },
    })


def _spec(handle, engine, stats) -> WorkerSpec:
    return WorkerSpec(
        gen_json=_rollout().model_dump_json(), val_json=_rollout().model_dump_json(), model=None, max_prompt_length=None,
        sandbox_json=SandboxConfig().model_dump_json(), queue=handle, engines=[(engine, "r0", stats)],
        max_sticky_sessions=1000, group_size=N, on_failure="drop_group", samples_per_step=GROUPS * N,
    )


@pytest.mark.timeout(120)
async def test_the_drivers_pause_and_weight_update_reach_a_workers_requests_in_flight(ray_local):
    """The driver pauses the engine actor, updates its weights and resumes it, as a colocated
    step does; the worker's group in flight waits meanwhile and finishes with the new version."""
    import ray

    from psrl.pipeline.ray.engine import RayEngine

    actor = ray.remote(ScriptedEngineActor).options(num_cpus=0, max_concurrency=1000).remote()
    stats = await resolve(actor.start_scripted.remote(0.2))
    driver_side = RayEngine(actor, "r0", stats)
    cfg = queue_config(TransferQueueConfig(transport="tcp", storage_units=1, in_process=True, request_timeout_s=20),
                       eta=1, samples_per_step=GROUPS * N)
    async with start_transfer_queue(cfg) as handle, handle.connect() as client:
        pool = RayRolloutWorkers(_spec(handle, actor, stats), ActorResources(num_cpus=0), 1, client=client, start_timeout_s=90)
        await pool.start()
        try:
            await driver_side.pause()
            done = anyio.Event()
            report = {}

            async def group() -> None:
                await TransferQueueGroups(client, samples_per_step=GROUPS * N).acquire(N)
                report["r"] = await pool.run_group_put({"prompt": "guess", "reward_model": {"ground_truth": 5}},
                                                       group_id="p0", n=N, validation=False, partition="train")
                done.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(group)
                with anyio.move_on_after(2.0):
                    await done.wait()
                assert not done.is_set(), "the group finished while the engine was paused"
                import torch

                await driver_side.update_weights([("w", torch.zeros(2))], 1)  # the scripted engine loads nothing
                await driver_side.resume()
            # A validation group goes to the "val" partition whole, outside admission.
            before = await client.statistics()
            val = await pool.run_group_put({"prompt": "guess", "reward_model": {"ground_truth": 5}},
                                           group_id="v0", n=N, validation=True, partition="val")
            assert val.kept and sorted(s.key for s in await client.list("val")) == [f"v0/{j}" for j in range(N)]
            after = await client.statistics()
            assert (after.accepted, after.running) == (before.accepted, before.running)
        finally:
            await pool.aclose()
        assert report["r"].kept
        meta = await client.get_meta("train", N, ["min_version", "max_version"], consumer="check")
        batch = await client.get_data(meta, ["min_version", "max_version"])
        assert batch.column("min_version").to_pylist() == [1] * N == batch.column("max_version").to_pylist()
    ray.kill(actor)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sandbox", ["bubblewrap", pytest.param("docker", marks=pytest.mark.docker)])
async def test_a_worker_killed_mid_group_loses_and_duplicates_no_group(ray_local, sandbox, tmp_path):
    """Each worker holds one warm sandbox; the killed worker's is reaped on its node."""
    import ray

    from tests.sandboxes.helpers import require

    require(sandbox)
    sandbox_cfg = SandboxConfig.model_validate({"spec": {"backend": sandbox, "state_dir": str(tmp_path / "state")},
                                                "pool": {"warm": 1}})
    engine = ray.remote(ScriptedEngineActor).options(num_cpus=0, max_concurrency=1000).remote()
    stats = await resolve(engine.start_scripted.remote(1.0))
    cfg = queue_config(TransferQueueConfig(transport="tcp", storage_units=1, in_process=True, request_timeout_s=20),
                       eta=0, samples_per_step=GROUPS * N)
    async with start_transfer_queue(cfg) as handle, handle.connect() as client:
        spec = WorkerSpec(
            gen_json=_rollout().model_dump_json(), val_json=_rollout().model_dump_json(), model=None, max_prompt_length=None,
            sandbox_json=sandbox_cfg.model_dump_json(), queue=handle, engines=[(engine, "r0", stats)],
            max_sticky_sessions=1000, group_size=N, on_failure="drop_group", samples_per_step=GROUPS * N,
        )
        pool = RayRolloutWorkers(spec, ActorResources(num_cpus=0), 2, client=client, start_timeout_s=120)
        assert isinstance(pool, QueueingGroupRollout)
        queue = TransferQueueGroups(client, samples_per_step=GROUPS * N)
        reports = {}
        await pool.start()
        try:
            victim = pool.workers[0]

            async def one(i: int) -> None:
                await queue.acquire(N)  # the driver's admission, as the scheduler does
                row = {"prompt": "guess", "reward_model": {"ground_truth": 5}}
                reports[i] = await pool.run_group_put(row, group_id=f"g{i}", n=N, validation=False, partition="train")

            async with anyio.create_task_group() as tg:
                for i in range(GROUPS):
                    tg.start_soon(one, i)
                with anyio.fail_after(30):
                    while victim.busy == 0 or pool.workers[1].busy == 0:
                        await anyio.sleep(0.05)
                await anyio.sleep(0.3)  # mid-group: its episodes are waiting on the engine
                ray.kill(victim.actor, no_restart=True)
        finally:
            await pool.aclose()
        assert sorted(reports) == list(range(GROUPS)) and all(r.kept for r in reports.values())
        assert pool.worker_restarts == 1 and pool.reissued_groups >= 1
        # Its warm sandbox (a bubblewrap state dir, or a container and its volumes) was swept on
        # its node by the reaper task, before the replacement's own start-up sweep could.
        assert pool.metrics()["rollout/reaped_sandboxes"] == 1
        assert all(r.produced_by != victim.where for r in reports.values())
        # Every group exactly once in the queue, produced where the report says.
        listed = sorted(s.key for s in await client.list("train"))
        assert listed == sorted(f"g{i}/{j}" for i in range(GROUPS) for j in range(N))
        meta = await client.get_meta("train", GROUPS * N, ["group_id", "produced_by"], consumer="check")
        batch = await client.get_data(meta, ["group_id", "produced_by"])
        where = dict(zip(batch.column("group_id").to_pylist(), batch.column("produced_by").to_pylist()))
        assert where == {f"g{i}": reports[i].produced_by for i in range(GROUPS)}
        # Admission is exact: every group accepted once, nothing left running.
        s = await client.statistics()
        assert s.accepted == GROUPS * N and s.running == 0
    ray.kill(engine)


@pytest.mark.parametrize("launcher, workers, groups", [("local", 3, 2), ("ray", 0, 2), ("ray", 3, 6)])
def test_max_concurrency_bounds_episodes_per_runner_so_every_worker_gets_groups(launcher, workers, groups):
    """``*.rollout.agent.max_concurrency`` is per runner: with N rollout workers the scheduler keeps
    N times as many groups in flight (it once capped them at one runner's share, so a second
    worker never got a group)."""
    from pathlib import Path

    from psrl.config import load_config
    from psrl.pipeline.train import schedule_config

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "quickstart" / "config.yaml"
    cfg = load_config(recipe, [f"launcher={launcher}", f"ray.rollout_workers={workers}",
                               "*.rollout.agent.max_concurrency=8", "*.rollout.sampling.n=4"])
    sched = schedule_config(cfg)
    assert (sched.max_running_groups, sched.val_concurrency) == (groups, groups)
