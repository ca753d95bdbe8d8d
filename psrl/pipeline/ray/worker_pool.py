"""The driver's side of rollout workers on Ray: ``RayRolloutWorkers`` hands groups (a row and a
group id) to worker actors and gets ``GroupReport``s back; it implements
``QueueingGroupRollout`` for the scheduler.

A group goes to the live worker with the fewest groups in flight. A worker that dies (its actor
or its node) loses no group: the groups it held are issued again, under the same admission
slots, to the other workers, and a replacement worker is started (``rollout/worker_restarts``).
Its sandboxes are reaped on its node: bubblewrap sandboxes die with it (``--die-with-parent``),
and a task pinned to that node, once the worker's process has exited, sweeps the containers and
volumes it owned (``rollout/reaped_sandboxes``; skipped when the node itself is gone). A group that the dead worker had already written to the queue is not issued again:
the queue is asked first.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import anyio

from psrl.config.schema import ActorResources
from psrl.log import get_logger
from psrl.pipeline.protocols import EpisodeOutcome, GroupReport
from psrl.pipeline.ray.common import RayLaunchError, actor_options, kill_actors, resolve
from psrl.pipeline.ray.rollout_worker import RolloutWorkerActor, WorkerSpec, reap_dead_worker_sandboxes
from psrl.trajectory import Status

log = get_logger("psrl.ray")

# Concurrent calls one worker actor serves (its runner's limiter bounds the episodes).
_WORKER_CONCURRENCY = 10_000
_STOP_TIMEOUT_S = 30.0
_REAP_TIMEOUT_S = 60.0


@dataclass
class _Worker:
    name: str
    actor: Any
    serving: Any  # the ref of its ``serve`` call
    where: str = ""
    node_id: str = ""
    pid: int = 0
    busy: int = 0
    dead: bool = False


class RayRolloutWorkers:
    def __init__(self, spec: WorkerSpec, resources: ActorResources, count: int, *, client: Any,
                 max_restarts: int = 16, start_timeout_s: float = 600.0) -> None:
        if count < 1:
            raise ValueError(f"ray.rollout_workers must be >= 1 for worker actors, got {count}")
        self.spec, self.resources, self.count = spec, resources, count
        self.client = client  # the driver's queue client: asks whether a lost group was put
        self.max_restarts, self.start_timeout_s = max_restarts, start_timeout_s
        self.workers: list[_Worker] = []
        self.worker_restarts = 0
        self.reissued_groups = 0
        self.reaped_sandboxes = 0
        self._names = itertools.count()
        self._live = anyio.Event()  # set while at least one worker is live

    # ---- life cycle ----------------------------------------------------------------------

    async def start(self) -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(self.count):
                tg.start_soon(self._start_one)

    async def _start_one(self) -> _Worker:
        import ray

        name = f"w{next(self._names)}"
        cls = ray.remote(RolloutWorkerActor).options(**actor_options(self.resources, max_concurrency=_WORKER_CONCURRENCY))
        actor = cls.remote()
        worker = _Worker(name, actor, actor.serve.remote(name, self.spec))
        try:
            with anyio.fail_after(self.start_timeout_s):
                info = await resolve(actor.wait_ready.remote())
        except TimeoutError:
            kill_actors([actor])
            raise RayLaunchError(
                f"rollout worker {name} did not start within {self.start_timeout_s:g} s (ray.actor_start_timeout_s): "
                f"the cluster may lack ray.rollout_worker's resources (available now: {ray.available_resources()})"
            ) from None
        except BaseException:
            kill_actors([actor])
            raise
        worker.where, worker.node_id, worker.pid = info["where"], info["node_id"], int(info["pid"])
        self.workers.append(worker)
        self._live.set()
        log.info("rollout worker on ray", worker=worker.where, node=info["node_ip"])
        return worker

    async def aclose(self) -> None:
        """Stop every worker (its groups are cancelled, its sandboxes closed), then kill it."""
        import ray

        with anyio.CancelScope(shield=True):
            live = [w for w in self.workers if not w.dead]
            for w in live:
                w.actor.stop.remote()
            refs = [w.serving for w in live]
            if refs:
                await anyio.to_thread.run_sync(lambda: ray.wait(refs, num_returns=len(refs), timeout=_STOP_TIMEOUT_S))
            kill_actors([w.actor for w in self.workers])

    def metrics(self) -> dict[str, float]:
        """Step metrics of the workers (the scheduler logs them with every step)."""
        return {
            "rollout/workers_live": float(sum(not w.dead for w in self.workers)),
            "rollout/worker_restarts": float(self.worker_restarts),
            "rollout/reissued_groups": float(self.reissued_groups),
            "rollout/reaped_sandboxes": float(self.reaped_sandboxes),
        }

    # ---- groups --------------------------------------------------------------------------

    async def _pick(self) -> _Worker:
        while True:
            live = [w for w in self.workers if not w.dead]
            if live:
                return min(live, key=lambda w: w.busy)
            if self._live.is_set():
                self._live = anyio.Event()
            await self._live.wait()

    async def run_group_put(
        self, row: Mapping[str, Any], *, group_id: str, n: int, validation: bool, partition: str
    ) -> GroupReport:
        import ray

        while True:
            worker = await self._pick()
            worker.busy += 1
            try:
                ref = worker.actor.run_group.remote(dict(row), group_id, n, validation, partition)
                try:
                    return await resolve(ref)
                except anyio.get_cancelled_exc_class():
                    worker.actor.cancel.remote(group_id)  # fire and forget: the worker stops it
                    raise
                except ray.exceptions.RayActorError as exc:
                    await self._lost(worker, exc)
                except ray.exceptions.RayTaskError as exc:
                    raise exc.as_instanceof_cause() from None
            finally:
                worker.busy -= 1
            with anyio.CancelScope(shield=True):
                if await self._already_put(group_id, partition):
                    return GroupReport(group_id, [EpisodeOutcome(Status.OK)] * n, True, worker.where)
            self.reissued_groups += 1
            log.warning("group issued again after its worker died", group=group_id, worker=worker.where)

    async def _already_put(self, group_id: str, partition: str) -> bool:
        prefix = f"{group_id}/"
        return any(s.key.startswith(prefix) for s in await self.client.list(partition))

    async def _lost(self, worker: _Worker, exc: Exception) -> None:
        if worker.dead:
            return
        worker.dead = True
        kill_actors([worker.actor])  # whatever of it is left (its sandboxes die with it)
        if self.worker_restarts >= self.max_restarts:
            raise RayLaunchError(
                f"rollout worker {worker.where} died and ray.rollout_worker_max_restarts={self.max_restarts} "
                f"replacements were used up: {exc}"
            )
        self.worker_restarts += 1
        log.error("rollout worker died; starting a replacement", worker=worker.where, error=str(exc))
        await self._reap(worker)  # first: the replacement may start on the same node
        await self._start_one()

    async def _reap(self, worker: _Worker) -> None:
        """Sweep the dead worker's sandboxes on its node, if the node is still there."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        alive = {n["NodeID"] for n in await anyio.to_thread.run_sync(ray.nodes) if n.get("Alive")}
        if worker.node_id not in alive:
            log.warning("node of a dead rollout worker is gone; nothing to reap there", worker=worker.where)
            return
        task = ray.remote(reap_dead_worker_sandboxes).options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(worker.node_id, soft=False)
        )
        try:
            with anyio.fail_after(_REAP_TIMEOUT_S):
                report = await resolve(task.remote(self.spec.sandbox_json, worker.pid))
        except Exception as e:  # the run goes on; the next pool started on that node sweeps them
            log.error("could not reap a dead rollout worker's sandboxes", worker=worker.where, error=str(e))
            return
        self.reaped_sandboxes += report["containers"] + report["dirs"]
        log.info("reaped a dead rollout worker's sandboxes", worker=worker.where, **report)


async def open_rollout_workers(cfg: Any, sched_cfg: Any, queue: Any, router: Any, stack: Any) -> RayRolloutWorkers:
    """``cfg.ray.rollout_workers`` worker actors for a run, closed by ``stack``; they route to the
    replicas of ``router`` (engine actors) and write into ``queue`` (a QueueHandle)."""
    gen, val = cfg.gen_actor_rollout_ref, cfg.train_actor_rollout_ref
    spec = WorkerSpec(
        gen_json=gen.rollout.model_dump_json(), val_json=val.rollout.model_dump_json(), model=gen.model.path,
        max_prompt_length=cfg.data.max_prompt_length, sandbox_json=cfg.sandbox.model_dump_json(), queue=queue,
        engines=[(e.actor, name, e.statistics()) for name, e in router.replicas.items()],
        max_sticky_sessions=gen.rollout.engine.max_sticky_sessions, group_size=sched_cfg.group_size,
        on_failure=sched_cfg.on_failure, samples_per_step=sched_cfg.samples_per_step,
    )
    client = await stack.enter_async_context(queue.connect())
    workers = RayRolloutWorkers(
        spec, cfg.ray.rollout_worker, cfg.ray.rollout_workers, client=client,
        max_restarts=cfg.ray.rollout_worker_max_restarts, start_timeout_s=cfg.ray.actor_start_timeout_s,
    )
    stack.push_async_callback(workers.aclose)
    await workers.start()
    return workers
