"""A rollout worker as a Ray actor: a ``RolloutRunner`` with its own sandbox pool, its own
``Router`` over the engine replicas' actors (the driver's routing policy: sticky sessions, least
loaded, fail-over), and its own transfer-queue client, so trajectories go from here into the
queue and the driver hears only a ``GroupReport``.

Admission stays the queue controller's (global, exact): the driver acquires a group's slots
before it hands the group out; the worker finishes them (accepted or rejected) and puts the
group, in that order, shielded from cancellation. Interruptible generation and weight updates
need nothing here: the driver pauses and updates the engine actors themselves, and every
worker's requests in flight on them continue (or resume) there.

Long-lived resources (sandbox pool, queue client) live in the ``serve`` call's task, which
runs until ``stop``; ``run_group`` calls use them from their own tasks.
"""

from __future__ import annotations

import os
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from typing import Any

import anyio

from psrl.log import get_logger

log = get_logger("psrl.ray")


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs, pickled to it once."""

    gen_json: str  # RolloutConfig of the training rollouts
    val_json: str  # ... of validation rollouts
    model: str | None  # the tokenizer's model path (resolved on the worker's node)
    max_prompt_length: int | None
    sandbox_json: str  # SandboxConfig
    queue: Any  # QueueHandle
    engines: list[tuple[Any, str, Any]]  # (actor handle, replica name, EngineStatistics)
    max_sticky_sessions: int
    group_size: int
    on_failure: str
    samples_per_step: int


class RolloutWorkerActor:
    """Runs whole groups and writes them into the transfer queue (an async Ray actor)."""

    def __init__(self) -> None:
        self.name = ""
        self.where = ""
        self._ready = anyio.Event()
        self._stop = anyio.Event()
        self._failure: str | None = None
        self._groups: dict[str, anyio.CancelScope] = {}
        self.runner: Any = None
        self.router: Any = None
        self.queue: Any = None

    def identity(self) -> dict[str, str]:
        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address(), "pid": str(os.getpid())}

    async def serve(self, name: str, spec: WorkerSpec) -> None:
        """Open the worker's resources and hold them until ``stop``."""
        try:
            async with AsyncExitStack() as stack:
                await self._open(name, spec, stack)
                self._ready.set()
                await self._stop.wait()
                for scope in self._groups.values():
                    scope.cancel()
        except BaseException as exc:
            self._failure = f"{type(exc).__name__}: {exc}"
            self._ready.set()
            raise

    async def _open(self, name: str, spec: WorkerSpec, stack: AsyncExitStack) -> None:
        from psrl.agent_loops.runner import RolloutRunner
        from psrl.config.rollout import RolloutConfig
        from psrl.config.sandbox import SandboxConfig
        from psrl.engines.router import Router
        from psrl.models import resolve_model_path
        from psrl.pipeline.ray.engine import RayEngine
        from psrl.pipeline.tq_queue import TransferQueueGroups
        from psrl.sandboxes.pool import SandboxPool

        self.name = name
        self.where = f"{name}@{self.identity()['node_id']}"
        tokenizer = None
        if spec.model is not None:  # None: byte-level agent data that needs no tokenizer (tests)
            from transformers import AutoTokenizer

            model_dir = await anyio.to_thread.run_sync(resolve_model_path, spec.model)
            tokenizer = await anyio.to_thread.run_sync(AutoTokenizer.from_pretrained, model_dir)
        sandbox = SandboxConfig.model_validate_json(spec.sandbox_json)
        pool = await stack.enter_async_context(SandboxPool(sandbox.spec, sandbox.pool))
        client = await stack.enter_async_context(spec.queue.connect())
        self.queue = TransferQueueGroups(client, samples_per_step=spec.samples_per_step)
        # The engines belong to the driver: this router routes, it never closes them.
        self.router = Router(max_sticky_sessions=spec.max_sticky_sessions, close_replicas=False)
        stack.push_async_callback(self.router.aclose)
        for actor, replica, stats in spec.engines:
            await self.router.add_replica(RayEngine(actor, replica, stats), replica)
        self.runner = RolloutRunner(
            RolloutConfig.model_validate_json(spec.gen_json), tokenizer=tokenizer, sandbox_pool=pool,
            max_prompt_length=spec.max_prompt_length, validation_rollout=RolloutConfig.model_validate_json(spec.val_json),
        )
        self.spec = spec
        log.info("rollout worker up", worker=self.where, engines=len(spec.engines))

    async def wait_ready(self) -> dict[str, str]:
        await self._ready.wait()
        if self._failure is not None:
            raise RuntimeError(f"rollout worker failed to start: {self._failure}")
        return {"name": self.name, "where": self.where, **self.identity()}

    async def run_group(self, row: dict, group_id: str, n: int, validation: bool, partition: str) -> Any:
        from psrl.pipeline.protocols import EpisodeOutcome, GroupReport
        from psrl.pipeline.selection import keep_group

        await self._ready.wait()
        if self._failure is not None or self._stop.is_set():
            raise RuntimeError(f"rollout worker {self.where} is not serving: {self._failure or 'stopped'}")
        with anyio.CancelScope() as scope:
            self._groups[group_id] = scope
            try:
                trajs = await self.runner.run_group(row, group_id=group_id, n=n, engine=self.router, validation=validation)
            finally:
                del self._groups[group_id]
        if scope.cancelled_caught:
            raise RuntimeError(f"group {group_id} was cancelled on {self.where}")
        trajs = [replace(t, produced_by=self.where) for t in trajs]
        episodes = [EpisodeOutcome(t.status, t.error) for t in trajs]
        with anyio.CancelScope(shield=True):  # admission and the queue must agree
            if partition == "train":
                keep = keep_group(trajs, self.spec.group_size, self.spec.on_failure)
                await self.queue.finish(n, accepted=bool(keep))
                if keep:
                    await self.queue.put_group(keep, partition=partition)
                kept = bool(keep)
            else:
                kept = len(trajs) == n
                if kept:
                    await self.queue.put_group(trajs, partition=partition)
        return GroupReport(group_id, episodes, kept, self.where)

    def cancel(self, group_id: str) -> None:
        scope = self._groups.get(group_id)
        if scope is not None:
            scope.cancel()

    def stop(self) -> None:
        self._stop.set()


def reap_dead_worker_sandboxes(sandbox_json: str, pid: int, wait_s: float = 30.0) -> dict[str, int]:
    """Run on a dead worker's node (a Ray task pinned there): wait until the worker's process
    ``pid`` has exited, then sweep what its sandbox backend left on this node (containers and
    volumes whose owner process is gone; bubblewrap leftovers). Sandboxes of live owners stay."""
    import time
    from dataclasses import asdict

    from psrl.config.sandbox import SandboxConfig
    from psrl.sandboxes import make_backend
    from psrl.sandboxes._state import pid_gone

    deadline = time.monotonic() + wait_s
    while not pid_gone(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rollout worker process {pid} still runs {wait_s:g} s after its kill")
        time.sleep(0.1)

    async def sweep() -> dict[str, int]:
        backend = make_backend(SandboxConfig.model_validate_json(sandbox_json).spec)
        try:
            return asdict(await backend.reap_stale())
        finally:
            await backend.aclose()

    return anyio.run(sweep)
