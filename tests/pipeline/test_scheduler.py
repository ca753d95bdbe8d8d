"""The scheduler with the simulated engine, environments and trainer (psrl.testing.sim_*): the
same code ``psrl train`` runs, at a time scale that makes a step take milliseconds."""

from __future__ import annotations

from collections import Counter

import anyio
import pytest

from psrl.pipeline import checkpoint
from psrl.pipeline.local_queue import LocalGroupQueue
from psrl.pipeline.metrics import FailureRateExceeded, first_leaf, staleness_histogram
from psrl.pipeline.scheduler import ScheduleConfig, Scheduler, eta_for
from psrl.pipeline.tasks import TaskSource
from psrl.testing.latency_model import LatencyModel
from psrl.testing.sim_engine import SimulatedEngine
from psrl.testing.sim_rollout import SimulatedRollout
from psrl.testing.sim_trainer import SimulatedTrainer

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

FAST = LatencyModel(median_tokens=40, max_tokens=256, time_scale=0.001, train_fixed_s=1.0, env_mean_s=0.3)


class Recorder:
    def __init__(self) -> None:
        self.train: list[tuple[int, dict]] = []
        self.val: list[tuple[int, dict]] = []

    def log(self, step, metrics, *, kind) -> None:
        (self.train if kind == "train" else self.val).append((step, dict(metrics)))


def make(mode: str, *, eta: int | None = None, model: LatencyModel = FAST, rows: int = 200, groups: int = 4, n: int = 2,
         steps: int = 8, sink=None, val_rows=(), **kw):
    eta = eta_for(mode, 2) if eta is None else eta
    cfg = ScheduleConfig(mode=mode, eta=eta, groups_per_step=groups, group_size=n, total_steps=steps, colocated=False, **kw)
    engine = SimulatedEngine(model)
    sched = Scheduler(
        cfg, engine=engine, rollout=SimulatedRollout(model), trainer=SimulatedTrainer(model),
        queue=LocalGroupQueue(eta=eta, samples_per_step=groups * n),
        tasks=TaskSource([{"prompt": f"row {i}"} for i in range(rows)], seed=1), val_rows=val_rows, sink=sink,
    )
    return sched, engine


@pytest.mark.parametrize("mode,eta", [("sync", 0), ("one_step_off", 1), ("async", 2), ("async", 4)])
async def test_versions_advance_and_staleness_stays_within_eta(mode, eta):
    rec = Recorder()
    sched, engine = make(mode, eta=eta, sink=rec)
    await sched.run()
    assert engine.version == sched.version == 8
    assert [s for s, _ in rec.train] == list(range(1, 9))
    hist = Counter()
    for _, m in rec.train:
        hist.update(staleness_histogram(m))
        assert m["samples"] == 8
    assert max(hist) <= eta, hist
    assert sum(hist.values()) == 64
    if mode == "sync":
        assert set(hist) == {0}
        assert all(m["staleness/mixed_version_samples"] == 0 for _, m in rec.train)
    else:
        assert max(hist) >= 1  # the pipeline did run ahead of the trainer


async def test_async_episodes_continue_across_weight_updates():
    """Interruptible generation: long episodes span updates, their tokens carry both versions."""
    rec = Recorder()
    slow_gen = LatencyModel(median_tokens=200, sigma=0.3, max_tokens=512, time_scale=0.001, train_fixed_s=0.2, env_mean_s=0.1)
    sched, _ = make("async", eta=3, model=slow_gen, sink=rec, steps=6)
    await sched.run()
    assert sum(m["staleness/mixed_version_samples"] for _, m in rec.train) > 0


async def test_sync_admits_next_batch_only_after_the_update():
    sched, engine = make("sync", steps=3)
    seen: list[tuple[int, int]] = []  # (engine version, running groups) at every trainer step

    def spy(batch):
        seen.append((engine.version, sched.running))
        return SimulatedTrainer.train_step(sched.trainer, batch)

    sched.trainer.train_step = spy
    await sched.run()
    assert seen == [(0, 0), (1, 0), (2, 0)]


async def test_validation_runs_every_eval_every_steps_into_its_own_partition():
    rec = Recorder()
    sched, _ = make("async", steps=4, sink=rec, eval_every=2, val_rows=[{"prompt": f"val {i}"} for i in range(3)], val_group_size=2)
    await sched.run()
    assert [s for s, _ in rec.val] == [0, 2, 4]
    assert all(m["val/samples"] == 6 for _, m in rec.val)
    assert sched.queue.pending_groups("val") == 0


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_resume_neither_repeats_nor_skips_rows(mode, tmp_path):
    def trained_rows(s):
        return [r for rec in s.history for r in rec.rows]

    # Uninterrupted reference: the rows of 6 steps.
    ref, _ = make(mode, steps=6, on_stale="refill")
    await ref.run()
    # Interrupted: a checkpoint at step 3, then the run dies after step 4 (its rows are lost).
    first, _ = make(mode, steps=4, on_stale="refill", save_every=3)
    first.on_checkpoint = lambda state, queued: checkpoint.save(tmp_path, state, first.trainer, queued=queued)
    await first.run()
    assert first.version == 4 and checkpoint.latest(tmp_path).name == "step_000003"
    second, _ = make(mode, steps=6, on_stale="refill")
    state = checkpoint.load(checkpoint.latest(tmp_path), second.trainer)
    assert state["version"] == 3 and second.trainer.steps == 3
    second.load_state_dict(state)
    await second.run()
    before = [r for rec in list(first.history)[:3] for r in rec.rows]
    after = trained_rows(second)
    combined = before + after
    assert len(combined) == len(set(combined)) == 6 * 4, "a row was trained twice"
    if mode == "sync":  # admission order is the data order: exactly the reference's rows
        assert sorted(combined) == sorted(trained_rows(ref))


async def test_failure_rate_above_threshold_stops_the_run():
    crashing = LatencyModel(median_tokens=20, max_tokens=64, time_scale=0.001, failure_rate=1.0, max_turns=3)
    sched, _ = make("async", model=crashing, max_failure_rate=0.5)
    with pytest.raises(BaseException) as info:
        await sched.run()
    leaf = first_leaf(info.value)
    assert isinstance(leaf, FailureRateExceeded)
    assert "max_failure_rate=0.5" in str(leaf) and "simulated environment failure" in str(leaf)


async def test_faults_are_recorded_and_training_goes_on():
    flaky = LatencyModel(median_tokens=20, max_tokens=64, time_scale=0.001, failure_rate=0.15, max_turns=3)
    rec = Recorder()
    sched, _ = make("async", model=flaky, sink=rec, steps=6, on_failure="keep_group", max_failure_rate=0.9)
    await sched.run()
    assert sched.version == 6
    assert rec.train[-1][1]["episodes/failed_total"] > 0
    assert sum(m["episodes/failed"] for _, m in rec.train) > 0  # kept groups carry their failures
    assert sched.trainer.samples_seen < 6 * 8  # ... but the trainer never stepped on them


async def test_cancelling_the_run_releases_every_request():
    sched, engine = make("async", steps=1000)
    with anyio.move_on_after(0.3):
        await sched.run()
    stats = engine.statistics()
    assert stats.requests_in_flight == 0
    assert sched.running == 0


async def test_interrupt_during_a_hung_weight_sync_keeps_state_consistent():
    """An engine that died with Ctrl-C never finishes ``update_weights``: the step's train part
    still completes and counts, the sync is abandoned after the grace period."""
    sched, engine = make("sync", steps=5)
    synced = anyio.Event()

    async def never_returns(named_tensors, version):
        synced.set()
        await anyio.sleep_forever()

    engine.update_weights = never_returns
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            async def interrupt():
                await synced.wait()
                tg.cancel_scope.cancel()
                sched.stop_step_within(0.1)

            tg.start_soon(interrupt)
            await sched.run()
    assert sched.version == 1 and sched.trainer.steps == 1
    assert sched.state_dict()["version"] == 1
