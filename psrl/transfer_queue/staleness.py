"""The off-policy bound: how far rollouts may run ahead of the trainer.

With staleness bound ``eta`` (in policy versions), trainer batch size ``B`` and current policy
version ``v``, every sample trained at version ``v`` may have been produced at version
``v - eta`` or later. Rollout workers therefore get an admission capacity of

    (eta + v + 1) * B - (accepted + running)

samples: ``accepted`` counts samples that landed in the queue (consumed or not), ``running``
those being generated. A worker that generates only what it was admitted never produces a
sample that would have to be thrown away for staleness. Samples evicted as stale anyway (the
bound tightened, a worker ignored its capacity) are taken off ``accepted`` so they can be
produced again.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessStatistics:
    version: int
    max_staleness: int
    batch_size: int
    accepted: int
    running: int
    capacity: int


class StalenessManager:
    """Admission accounting. Plain, synchronous and not thread-safe: one owner (the controller)
    calls it; rollout workers reach it through the queue client (``acquire_rollouts``,
    ``finish_rollouts``, ``set_version``)."""

    def __init__(self, max_staleness: int, batch_size: int, *, version: int = 0):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.version = version
        self.accepted = 0
        self.running = 0

    def capacity(self) -> int:
        return max(0, (self.max_staleness + self.version + 1) * self.batch_size - (self.accepted + self.running))

    def set_version(self, version: int) -> None:
        if version < self.version:
            raise ValueError(f"policy version went backwards: {self.version} -> {version}")
        self.version = version

    def oldest_allowed(self) -> int:
        """Samples whose oldest token is older than this are stale."""
        return self.version - self.max_staleness

    def submit(self, n: int) -> int:
        """Admit up to ``n`` rollouts now; returns how many were admitted (they count as running)."""
        if n < 0:
            raise ValueError(f"cannot submit {n} rollouts")
        granted = min(n, self.capacity())
        self.running += granted
        return granted

    def finish(self, accepted: int, rejected: int = 0) -> None:
        """``accepted`` rollouts landed in the queue, ``rejected`` were discarded (filtered,
        failed): both stop running; only the rejected free capacity."""
        if accepted < 0 or rejected < 0:
            raise ValueError(f"finish(accepted={accepted}, rejected={rejected}): counts must be >= 0")
        if accepted + rejected > self.running:
            raise ValueError(
                f"finish(accepted={accepted}, rejected={rejected}) but only {self.running} rollouts are running"
            )
        self.running -= accepted + rejected
        self.accepted += accepted

    def evicted(self, n: int) -> None:
        self.accepted = max(0, self.accepted - n)

    def statistics(self) -> StalenessStatistics:
        return StalenessStatistics(
            self.version, self.max_staleness, self.batch_size, self.accepted, self.running, self.capacity()
        )

    def state(self) -> dict:
        return {"version": self.version, "accepted": self.accepted}

    def load_state(self, state: dict) -> None:
        self.version, self.accepted, self.running = int(state["version"]), int(state["accepted"]), 0
