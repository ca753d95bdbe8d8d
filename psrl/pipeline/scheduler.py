"""One scheduler for every mode: rollouts run ahead of the trainer by at most ``eta`` versions.

- ``sync`` is eta = 0: only what the current policy will train on is admitted; the next batch is
  admitted after the weights are updated (on-policy).
- ``one_step_off`` is eta = 1: the next batch generates while the trainer steps on this one.
- ``async`` is eta = ``transfer_queue.max_staleness``; episodes in flight continue across weight
  updates (the engine pauses, loads and resumes them), so a sample's tokens may carry several
  versions. Its staleness is judged by its oldest token.

Admission is the queue's (``StalenessManager``): at policy version ``v`` a group may start while
``accepted + running < (eta + v + 1) * B`` samples, ``B`` samples per step. Groups that never
reach the trainer (dropped as failed, evicted as stale) give their slots back. So a sample
consumed at version ``v`` was admitted at ``v - eta`` or later; a long-tailed group that outlives
that bound is evicted by the queue, and its row is dropped or generated again (``on_stale``).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import pyarrow as pa

from psrl.engines import InferenceEngine
from psrl.trajectory import Trajectory, from_arrow

from psrl.log import get_logger

from .metrics import METRIC_FIELDS, FailureGuard, batch_metrics
from .protocols import (
    GroupQueue, GroupReport, GroupRollout, PolicyTrainer, QueueingGroupRollout, ShardedPolicyTrainer, TakenBatch,
)
from .publish import publish_weights
from .schedule_config import Mode, ScheduleConfig, eta_for
from .selection import keep_group, trainable, trainable_mask
from .step_report import MetricsSink, StepRecord, StepTimes, log_first_error, step_metrics
from .tasks import TaskSource
from .trainer_thread import TrainerThread
from .timed_engine import TimedEngine

# The config and step types live beside this module; they are importable from here as before.
__all__ = ["MetricsSink", "Mode", "ScheduleConfig", "Scheduler", "StepRecord", "eta_for"]

log = get_logger("psrl.pipeline")


class Scheduler:
    def __init__(
        self,
        config: ScheduleConfig,
        *,
        engine: InferenceEngine,
        rollout: GroupRollout,
        trainer: PolicyTrainer,
        queue: GroupQueue,
        tasks: TaskSource,
        val_rows: Sequence[Mapping[str, Any]] = (),
        sink: MetricsSink | None = None,
        # every save_every steps, in a thread: (state_dict, the queued groups' batch or None)
        on_checkpoint: Callable[[dict[str, Any], pa.RecordBatch | None], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cfg = config
        self.engine = engine if isinstance(engine, TimedEngine) else TimedEngine(engine)
        self.rollout, self.trainer, self.queue, self.tasks = rollout, trainer, queue, tasks
        self.val_rows = list(val_rows)
        self.sink = sink
        self.on_checkpoint = on_checkpoint
        self._clock = clock
        self.version = 0
        self.running = 0
        self.guard = FailureGuard(config.max_failure_rate, window=max(16, config.groups_per_step * config.group_size))
        self._seq = 0  # admission counter: makes group ids unique across the run and its resumes
        self._rows: OrderedDict[str, int] = OrderedDict()  # admitted, not yet trained on: gid -> row
        self.history: deque[StepRecord] = deque(maxlen=100_000)
        self.val_history: list[tuple[int, dict[str, float]]] = []
        self.dropped_stale = 0
        self.dropped_failed = 0
        self._fields = tuple(dict.fromkeys([*trainer.fields, *METRIC_FIELDS]))
        self._step_scope: anyio.CancelScope | None = None
        self._requeue: tuple[pa.Table | pa.RecordBatch, dict[str, int]] | None = None  # from a checkpoint
        self._group_s: list[float] = []  # rollout wall time of the groups finished since the last step
        self._trainer_thread = TrainerThread()  # train steps and checkpoint saves, always this one thread

    # ---- state ---------------------------------------------------------------------------

    def state_dict(self, queued: Sequence[str] = ()) -> dict[str, Any]:
        """Everything but the trainer's own state; consistent between steps. ``queued``: ids of
        groups saved with the checkpoint (``snapshot``); their rows are not replayed."""
        saved = {g: self._rows[g] for g in queued if g in self._rows}
        return {
            "version": self.version,
            "seq": self._seq,
            "tasks": self.tasks.state_dict(not_trained=[r for g, r in self._rows.items() if g not in saved]),
            "queued": saved,
            "dropped_stale": self.dropped_stale,
            "dropped_failed": self.dropped_failed,
            "failed_episodes": self.guard.failed_total,
            "episodes": self.guard.episodes_total,
            "val_history": self.val_history,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Call before ``run``; the queue is told in ``run``."""
        self.version = int(state["version"])
        self._seq = int(state["seq"])
        self.tasks.load_state_dict(state["tasks"])
        self.dropped_stale, self.dropped_failed = int(state["dropped_stale"]), int(state["dropped_failed"])
        self.guard.failed_total, self.guard.episodes_total = int(state["failed_episodes"]), int(state["episodes"])
        self.val_history = [(int(s), dict(m)) for s, m in state.get("val_history", [])]
        queued = {str(g): int(r) for g, r in state.get("queued", {}).items()}
        if queued:
            if state.get("queued_batch") is None:
                raise ValueError(f"the checkpoint names {len(queued)} queued groups but holds no data for them")
            self._requeue = (state["queued_batch"], queued)

    async def snapshot(self, timeout_s: float = 120.0) -> tuple[dict[str, Any], pa.RecordBatch | None]:
        """``state_dict`` plus a copy of the groups waiting in the queue, for a checkpoint. The
        groups are generated already: a resumed run trains them rather than generating them
        again. If the queue cannot be read (it died with an interrupt) their rows are replayed."""
        taken = None
        with anyio.move_on_after(timeout_s):
            try:
                taken = await self.queue.queued("train")
            except Exception as e:  # noqa: BLE001 - the checkpoint must still be written
                log.warning("queued groups not saved; their rows will be generated again", error=repr(e))
        if taken is None or not taken.group_ids:
            return self.state_dict(), None
        state = self.state_dict(queued=taken.group_ids)
        batch = taken.batch
        if len(state["queued"]) < len(taken.group_ids):  # a group no longer tracked (trained, evicted)
            keep = pa.array([g in state["queued"] for g in batch.column("group_id").to_pylist()])
            batch = batch.filter(keep)
        return state, batch

    async def _put_back_queued(self) -> None:
        """Resume: the groups saved in the checkpoint go back into the queue, admitted and
        accepted as a finished rollout is, in their old order."""
        if self._requeue is None:
            return
        batch, rows = self._requeue
        self._requeue = None
        groups: dict[str, list[Trajectory]] = {}
        for t in from_arrow(batch):
            groups.setdefault(t.group_id, []).append(t)
        if set(groups) != set(rows):
            raise ValueError(f"checkpoint: queued groups {sorted(set(groups) ^ set(rows))} lack data or rows")
        for gid, trajs in groups.items():
            self._rows[gid] = rows[gid]
            await self.queue.acquire(len(trajs))
            await self.queue.finish(len(trajs), accepted=True)
            await self.queue.put_group(trajs, partition="train")
        await self._handle_evicted()  # restored into a newer version: stale ones go by ``on_stale``
        log.info("queued groups restored from the checkpoint", groups=len(groups))

    # ---- running -------------------------------------------------------------------------

    async def run(self) -> None:
        """Train until ``total_steps``. Cancelling it stops rollouts and releases everything they
        hold; a step that has begun (train + weight sync) completes first, so the state stays
        consistent for a checkpoint."""
        if self.version:
            await self.queue.resume_at(self.version)
        await self._put_back_queued()
        if self.engine.statistics().version != self.version:  # resumed: serve the restored policy
            await publish_weights(self.trainer, self.engine, self.version)
        if self.cfg.eval_every and self.version == 0 and self.val_rows:
            await self.validate()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._produce)
            await self._train_loop()
            tg.cancel_scope.cancel()

    def stop_step_within(self, grace_s: float) -> None:
        """After the run was cancelled: give a step in progress ``grace_s`` seconds more. Its
        train step always completes (the version is then bumped, so a checkpoint stays
        consistent); a weight sync to an engine that died with the interrupt is abandoned (a
        resumed run publishes the weights again)."""
        if self._step_scope is not None:
            self._step_scope.deadline = min(self._step_scope.deadline, anyio.current_time() + grace_s)

    async def _produce(self) -> None:
        n = self.cfg.group_size
        slots = anyio.Semaphore(self.cfg.max_running_groups)
        async with anyio.create_task_group() as groups:
            while True:
                await slots.acquire()
                try:
                    await self.queue.acquire(n)
                except BaseException:
                    slots.release()
                    raise
                index, row = self.tasks.next()
                gid = f"g{self._seq}-r{index}"
                self._seq += 1
                self._rows[gid] = index
                self.running += 1
                groups.start_soon(self._run_group, gid, row, slots)

    async def _run_group(self, gid: str, row: Mapping[str, Any], slots: anyio.Semaphore) -> None:
        n = self.cfg.group_size
        queueing = isinstance(self.rollout, QueueingGroupRollout)  # a worker elsewhere puts the group itself
        t0 = self._clock()
        try:
            if queueing:
                report = await self.rollout.run_group_put(row, group_id=gid, n=n, validation=False, partition="train")
            else:
                trajs = await self.rollout.run_group(row, group_id=gid, n=n, engine=self.engine, validation=False)
            self._group_s.append(self._clock() - t0)
        except BaseException:
            # Cancelled with the run (the queue's admission ends with it). Its row stays in
            # ``_rows``, so a checkpoint replays it.
            self.running -= 1
            slots.release()
            raise
        try:
            if queueing:
                await self._reported(report)
                return
            self.guard.record(trajs)
            keep = self._keep(trajs)
            with anyio.CancelScope(shield=True):  # admission and the queue must agree
                # Accepted before the put: a group evicted on arrival is then taken off again.
                await self.queue.finish(n, accepted=bool(keep))
                if keep:
                    await self.queue.put_group(keep, partition="train")
                else:
                    self.dropped_failed += 1
                    self._rows.pop(gid, None)  # a failed row is recorded in metrics, not retried
                await self._handle_evicted()
        finally:
            self.running -= 1
            slots.release()

    async def _reported(self, report: GroupReport) -> None:
        """A group a rollout worker finished and (if kept) put: its metadata only."""
        self.guard.record(report.episodes)
        if not report.kept:
            self.dropped_failed += 1
            self._rows.pop(report.group_id, None)
        with anyio.CancelScope(shield=True):
            await self._handle_evicted()

    def _keep(self, trajs: Sequence[Trajectory]) -> list[Trajectory]:
        return keep_group(trajs, self.cfg.group_size, self.cfg.on_failure)

    async def _handle_evicted(self) -> None:
        gids = await self.queue.take_evicted()
        if not gids:
            return
        self.dropped_stale += len(gids)
        rows = [self._rows.pop(g) for g in gids if g in self._rows]
        if self.cfg.on_stale == "refill":
            self.tasks.push_front(rows)

    async def _train_loop(self) -> None:
        last = self._clock()
        while self.version < self.cfg.total_steps:
            version = self.version
            busy0, t0 = self.engine.busy_seconds(), self._clock()
            taken = await self.queue.take(
                partition="train", n_groups=self.cfg.groups_per_step, group_size=self.cfg.group_size,
                consumer="trainer", fields=self._fields,
            )
            t_taken = self._clock()
            # A step that has begun completes even when the run is cancelled (the trainer's state
            # and ours move together); ``stop`` bounds how long its weight sync may then take.
            with anyio.CancelScope(shield=True) as step_scope:
                self._step_scope = step_scope
                if self.cfg.colocated:
                    await self.engine.pause()
                t_paused = self._clock()
                try:
                    train_metrics = await self._trainer_thread.run(self._train_call(taken))
                    if taken.release is not None:
                        await taken.release()
                    t_trained = self._clock()
                    rows = [self._rows.pop(g) for g in taken.group_ids if g in self._rows]
                    self.version = version + 1
                    await publish_weights(self.trainer, self.engine, self.version)
                finally:
                    if self.cfg.colocated and not step_scope.cancel_called:
                        await self.engine.resume()
                t_synced = self._clock()
                await self.queue.set_version(self.version)
                await self._handle_evicted()
            self._step_scope = None
            if step_scope.cancelled_caught:  # stopped part way by ``stop_step_within``
                await anyio.lowlevel.checkpoint()  # the run is being cancelled: raise here
                return
            times = StepTimes(last, t0, t_taken, t_paused, t_trained, t_synced)
            last = t_synced
            groups, self._group_s = self._group_s, []
            metrics = step_metrics(
                taken.batch, self.cfg, version=version, step=self.version, trained=train_metrics, times=times,
                generation_busy_s=self.engine.busy_seconds() - busy0, requests=self.engine.take_requests(), group_s=groups,
                totals={
                    "staleness/dropped_groups_total": float(self.dropped_stale),
                    "episodes/failed_total": float(self.guard.failed_total),
                    "groups/dropped_failed_total": float(self.dropped_failed),
                    **(self.rollout.metrics() if hasattr(self.rollout, "metrics") else {}),  # e.g. rollout/worker_restarts
                },
            )
            self.history.append(StepRecord(self.version, taken.group_ids, rows, int(metrics["staleness/max"]), times.wall_s))
            if self.sink is not None:
                self.sink.log(self.version, metrics, kind="train")
            step = self.version
            if self.cfg.eval_every and self.val_rows and (step % self.cfg.eval_every == 0 or step == self.cfg.total_steps):
                await self.validate()
            if self.cfg.save_every and self.on_checkpoint is not None and step % self.cfg.save_every == 0:
                with anyio.CancelScope(shield=True):
                    state, queued = await self.snapshot()
                    await self._trainer_thread.run(partial(self.on_checkpoint, state, queued))

    def _train_call(self, taken: TakenBatch) -> Callable[[], Mapping[str, float]]:
        if taken.meta is not None and isinstance(self.trainer, ShardedPolicyTrainer):
            # Trainer ranks fetch their own shares by metadata; the batch here holds scalars only.
            ok = trainable_mask(taken.batch)
            rows = [i for i, keep in enumerate(ok.to_pylist()) if keep]
            return partial(self.trainer.train_step_meta, taken.meta.select(rows), taken.batch.filter(ok))
        return partial(self.trainer.train_step, trainable(taken.batch))

    async def validate(self) -> dict[str, float]:
        """Every validation row, ``val_group_size`` episodes each, at the current version; the
        groups go through the queue's "val" partition."""
        step = self.version
        n = self.cfg.val_group_size
        limiter = anyio.CapacityLimiter(self.cfg.val_concurrency)
        put = 0

        async def one(i: int, row: Mapping[str, Any]) -> None:
            nonlocal put
            async with limiter:
                if isinstance(self.rollout, QueueingGroupRollout):
                    report = await self.rollout.run_group_put(row, group_id=f"val{step}-{i}", n=n, validation=True, partition="val")
                    put += report.kept
                    return
                trajs = await self.rollout.run_group(row, group_id=f"val{step}-{i}", n=n, engine=self.engine, validation=True)
            if len(trajs) == n:
                await self.queue.put_group(trajs, partition="val")
                put += 1

        t0 = self._clock()
        async with anyio.create_task_group() as tg:
            for i, row in enumerate(self.val_rows):
                tg.start_soon(one, i, row)
        taken = await self.queue.take(partition="val", n_groups=put, group_size=n, consumer="validator", fields=METRIC_FIELDS)
        if taken.release is not None:
            await taken.release()
        metrics = batch_metrics(taken.batch, version=step, prefix="val/")
        if metrics.get("val/episodes/failed"):
            log_first_error(taken.batch, "validation episodes failed", step)
        metrics["val/time_s"] = self._clock() - t0
        self.val_history.append((step, metrics))
        if self.sink is not None:
            self.sink.log(step, metrics, kind="val")
        return metrics
