"""Queued data in pipeline checkpoints: a run interrupted between steps saves the groups that were
generated and waiting in the transfer queue; the resumed run trains them without generating them
again and trains no group twice. Real pieces: the ZeroMQ transfer queue (service processes), the
scheduler, the pipeline checkpoint; generation and training are the simulated ones."""

from __future__ import annotations

from contextlib import asynccontextmanager


import pytest

from psrl.config import TransferQueueConfig
from psrl.pipeline import checkpoint
from psrl.pipeline.scheduler import ScheduleConfig, Scheduler
from psrl.pipeline.tasks import TaskSource
from psrl.pipeline.tq_queue import TransferQueueGroups, queue_config
from psrl.testing.latency_model import LatencyModel
from psrl.testing.sim_engine import SimulatedEngine
from psrl.testing.sim_rollout import SimulatedRollout
from psrl.testing.sim_trainer import SimulatedTrainer
from psrl.transfer_queue import start_transfer_queue

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

MODEL = LatencyModel(median_tokens=40, max_tokens=256, time_scale=0.001, train_fixed_s=2.0, env_mean_s=0.3)
GROUPS, N, ETA = 4, 2, 2


class Spy(SimulatedRollout):
    """Records every group generated: id -> its trajectories' response ids."""

    def __init__(self) -> None:
        super().__init__(MODEL)
        self.generated: dict[str, list] = {}

    async def run_group(self, row, *, group_id, n, engine, validation):
        trajs = await super().run_group(row, group_id=group_id, n=n, engine=engine, validation=validation)
        self.generated[group_id] = [t.response_ids.tolist() for t in trajs]
        return trajs


class Trainer(SimulatedTrainer):
    """Records what every step trained on: group id -> response ids."""

    def __init__(self) -> None:
        super().__init__(MODEL)
        self.trained: list[dict[str, list]] = []

    def train_step(self, batch):
        step: dict[str, list] = {}
        for g, ids in zip(batch.column("group_id").to_pylist(), batch.column("response_ids").to_pylist(), strict=True):
            step.setdefault(g, []).append(ids)
        self.trained.append(step)
        return super().train_step(batch)


@asynccontextmanager
async def scheduler(steps: int, **kw):
    cfg = ScheduleConfig(mode="async", eta=ETA, groups_per_step=GROUPS, group_size=N, total_steps=steps,
                         colocated=False, on_stale="refill", **kw)
    # Services in this event loop (real ipc sockets) keep the test fast; tests/transfer_queue/
    # test_checkpoint.py restarts service processes.
    base = TransferQueueConfig(transport="ipc", in_process=True, request_timeout_s=10, wait_slice_s=0.5)
    async with start_transfer_queue(queue_config(base, eta=ETA, samples_per_step=cfg.samples_per_step)) as handle:
        async with handle.connect() as client:
            yield Scheduler(
                cfg, engine=SimulatedEngine(MODEL), rollout=Spy(), trainer=Trainer(),
                queue=TransferQueueGroups(client, samples_per_step=cfg.samples_per_step),
                tasks=TaskSource([{"prompt": f"row {i}"} for i in range(200)], seed=1),
            )


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_resumed_run_trains_the_queued_groups_without_generating_them_again(tmp_path, anyio_backend):
    # The first run checkpoints after step 3; it goes on to step 5 and dies (steps 4-5 are lost).
    async with scheduler(5, save_every=3) as first:
        saved: list = []

        def on_checkpoint(state, queued):
            saved.append((state, queued))
            checkpoint.save(tmp_path, state, first.trainer, queued=queued)

        first.on_checkpoint = on_checkpoint
        await first.run()
    state, queued = saved[0]
    assert state["version"] == 3
    # eta=2: rollouts ran ahead, so whole generated groups were waiting in the queue.
    assert state["queued"] and queued is not None and queued.num_rows == N * len(state["queued"])
    assert not set(state["queued"].values()) & set(state["tasks"]["replay"]), "a queued row is also replayed"

    async with scheduler(8) as second:
        loaded = checkpoint.load(checkpoint.latest(tmp_path), second.trainer)
        assert loaded["queued_batch"].num_rows == queued.num_rows
        second.load_state_dict(loaded)
        await second.run()

    restored = set(state["queued"])
    trained_before = [g for step in first.trainer.trained[:3] for g in step]
    trained_after = [g for step in second.trainer.trained for g in step]
    # Every queued group was trained after the resume, with the data generated before it ...
    assert restored <= set(trained_after), restored - set(trained_after)
    after = {g: ids for step in second.trainer.trained for g, ids in step.items()}
    for g in restored:
        assert sorted(after[g]) == sorted(first.rollout.generated[g]), f"group {g} changed across the resume"
    # ... and none was generated again (by id or by dataset row).
    assert not restored & set(second.rollout.generated)
    regenerated_rows = {int(g.split("-r")[1]) for g in second.rollout.generated}
    assert not regenerated_rows & set(state["queued"].values())
    # No group and no row trained twice; 8 steps of distinct rows in all.
    combined = trained_before + trained_after
    assert len(combined) == len(set(combined)) == 8 * GROUPS
    rows = [int(g.split("-r")[1]) for g in combined]
    assert len(set(rows)) == len(rows)
