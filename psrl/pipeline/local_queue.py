"""An in-process ``GroupQueue``: finished groups in FIFO order, per partition, with the
transfer queue's ``StalenessManager`` for admission.

Used by the simulation benchmark (so it measures scheduling, not transport) and for
``transfer_queue.transport=inproc`` runs that need no ZeroMQ at all. ``psrl train`` uses the
transfer queue otherwise (``psrl.pipeline.tq_queue``); both pass the same tests.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import anyio

from psrl.trajectory import NO_VERSION, Trajectory, to_arrow
from psrl.transfer_queue.staleness import StalenessManager

from .protocols import TakenBatch


def group_min_version(trajectories: Sequence[Trajectory]) -> int:
    """The oldest policy version that produced any token of the group (NO_VERSION if none did)."""
    versions = [v for v in (t.min_version() for t in trajectories) if v != NO_VERSION]
    return min(versions) if versions else NO_VERSION


class LocalGroupQueue:
    def __init__(self, *, eta: int, samples_per_step: int) -> None:
        self.staleness = StalenessManager(eta, samples_per_step)
        self._groups: dict[str, OrderedDict[str, list[Trajectory]]] = {}
        self._evicted: list[str] = []
        self._changed = anyio.Event()
        self._closed = False

    def _partition(self, name: str) -> OrderedDict[str, list[Trajectory]]:
        return self._groups.setdefault(name, OrderedDict())

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _wait_change(self) -> None:
        if self._closed:
            raise RuntimeError("queue is closed")
        changed = self._changed
        await changed.wait()

    async def acquire(self, n: int) -> None:
        while self.staleness.capacity() < n:
            await self._wait_change()
        self.staleness.submit(n)

    async def finish(self, n: int, *, accepted: bool) -> None:
        self.staleness.finish(n if accepted else 0, 0 if accepted else n)
        self._notify()

    def _stale(self, trajectories: Sequence[Trajectory]) -> bool:
        v = group_min_version(trajectories)
        return v != NO_VERSION and v < self.staleness.oldest_allowed()

    def _evict(self, gid: str, trajectories: Sequence[Trajectory]) -> None:
        self._evicted.append(gid)
        self.staleness.evicted(len(trajectories))

    async def put_group(self, trajectories: Sequence[Trajectory], *, partition: str) -> None:
        if self._closed:
            raise RuntimeError("queue is closed")
        if not trajectories:
            raise ValueError("put_group needs at least one trajectory")
        gids = {t.group_id for t in trajectories}
        if len(gids) != 1:
            raise ValueError(f"put_group got trajectories of several groups: {sorted(gids)}")
        gid = gids.pop()
        part = self._partition(partition)
        if gid in part:
            raise ValueError(f"group {gid!r} is already in partition {partition!r}")
        if partition == "train" and self._stale(trajectories):
            self._evict(gid, trajectories)
        else:
            part[gid] = list(trajectories)
        self._notify()

    async def take(
        self, *, partition: str, n_groups: int, group_size: int, consumer: str, fields: Sequence[str]
    ) -> TakenBatch:
        part = self._partition(partition)
        while True:
            ready = [g for g, trajs in part.items() if len(trajs) >= group_size]
            if len(ready) >= n_groups:
                break
            await self._wait_change()
        gids = ready[:n_groups]
        trajs = [t for g in gids for t in part.pop(g)]
        return TakenBatch(to_arrow(trajs, fields), gids, [t.key for t in trajs])

    async def set_version(self, version: int) -> None:
        self.staleness.set_version(version)
        part = self._partition("train")
        for gid in [g for g, trajs in part.items() if self._stale(trajs)]:
            self._evict(gid, part.pop(gid))
        self._notify()

    async def take_evicted(self) -> list[str]:
        out, self._evicted = self._evicted, []
        return out

    async def queued(self, partition: str) -> TakenBatch:
        part = self._partition(partition)
        trajs = [t for group in part.values() for t in group]
        return TakenBatch(to_arrow(trajs), list(part), [t.key for t in trajs])

    async def resume_at(self, version: int) -> None:
        self.staleness.set_version(version)
        self.staleness.accepted = version * self.staleness.batch_size
        self._notify()

    def pending_groups(self, partition: str) -> int:
        return len(self._groups.get(partition, ()))

    async def aclose(self) -> None:
        self._closed = True
        self._notify()
