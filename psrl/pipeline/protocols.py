"""The seams the pipeline is wired from. Real and simulated parts both plug in here.

The scheduler (``psrl.pipeline.scheduler``) only knows these Protocols:

- ``GroupRollout``: runs one task (dataset row) as a GRPO group of ``n`` episodes against an engine;
- ``PolicyTrainer``: one optimizer step on a batch, the weights to publish, checkpoints;
- ``GroupQueue``: where finished groups wait for the trainer (the transfer queue, or an in-process
  buffer for the simulation benchmark);
- the engine is ``psrl.engines.InferenceEngine``.

``psrl.testing.sim_*`` implements the first three with timings from a latency model, so the
benchmark measures exactly the scheduling code that ``psrl train`` runs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import pyarrow as pa

from psrl.engines import InferenceEngine
from psrl.trajectory import Status, Trajectory


@runtime_checkable
class GroupRollout(Protocol):
    """Runs the ``n`` episodes of one row concurrently and returns their trajectories.

    Never raises for an env or engine failure (those are FAILED trajectories); cancellation
    propagates and releases every env, sandbox and engine request of the group.
    """

    async def run_group(
        self, row: Mapping[str, Any], *, group_id: str, n: int, engine: InferenceEngine, validation: bool
    ) -> list[Trajectory]: ...


@dataclass(frozen=True)
class EpisodeOutcome:
    """An episode as the failure guard sees it (``status``/``error`` like a ``Trajectory``'s)."""

    status: Status
    error: str | None = None


@dataclass(frozen=True)
class GroupReport:
    """What a rollout that writes its groups to the queue itself tells the scheduler."""

    group_id: str
    episodes: list[EpisodeOutcome]
    kept: bool  # accepted and put into the queue (else dropped: admission was given back)
    produced_by: str = ""


@runtime_checkable
class QueueingGroupRollout(Protocol):
    """Runs a row's ``n`` episodes elsewhere (a rollout worker) and writes the group into the
    queue there: admission ``finish`` then put for "train" (a group that fails the keep policy
    is finished as rejected), a plain put of a whole group for "val". The scheduler gets only
    the report. Never raises for env or engine failures; cancellation stops the group remotely."""

    async def run_group_put(
        self, row: Mapping[str, Any], *, group_id: str, n: int, validation: bool, partition: str
    ) -> GroupReport: ...


@runtime_checkable
class PolicyTrainer(Protocol):
    """The learner. ``train_step`` is blocking (CPU/GPU bound): the pipeline runs it in a worker
    thread so generation goes on meanwhile. ``fields`` are the trajectory columns it reads.
    ``named_tensors()`` gives the current weights (HF names) to publish to the engines."""

    fields: Sequence[str]

    def train_step(self, batch: pa.RecordBatch) -> Mapping[str, float]: ...

    def named_tensors(self) -> Iterable[tuple[str, Any]]: ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...


@runtime_checkable
class ShardedPolicyTrainer(PolicyTrainer, Protocol):
    """A learner whose ranks fetch their own shares of a step from the transfer queue: the
    scheduler hands it the step's ``KVBatchMeta`` and the scalar columns named in ``fields``
    (in ``meta`` order), never token data."""

    def train_step_meta(self, meta: Any, batch: pa.RecordBatch) -> Mapping[str, float]: ...


@dataclass
class TakenBatch:
    """Whole groups handed to one consumer: the data (only the asked-for columns) and their ids.

    ``meta`` is the transfer queue's ``KVBatchMeta`` of the batch (None for in-process queues).
    ``release``, when set, removes the samples from the queue: a take that fetched no token
    column leaves them there for whoever fetches them by ``meta`` (trainer ranks)."""

    batch: pa.RecordBatch
    group_ids: list[str]
    keys: list[str]
    meta: Any = None
    release: Callable[[], Awaitable[None]] | None = None


@runtime_checkable
class GroupQueue(Protocol):
    """Where finished groups wait, by partition ("train", "val"), and the staleness bound.

    Admission (the ``StalenessManager`` rule, counted in samples): ``acquire(n)`` waits until a
    group of ``n`` may start; ``finish(n, accepted=...)`` ends it (accepted: it is being put).
    ``set_version(v)`` evicts training groups whose oldest token is older than ``v - eta``; a group
    put already that stale is evicted on arrival. ``take_evicted()`` returns the ids evicted since
    the last call, so the scheduler can refill or drop their rows. ``take`` waits for ``n_groups``
    whole groups of ``group_size``, oldest first, and removes them from the queue.
    """

    async def acquire(self, n: int) -> None: ...

    async def finish(self, n: int, *, accepted: bool) -> None: ...

    async def put_group(self, trajectories: Sequence[Trajectory], *, partition: str) -> None: ...

    async def take(
        self, *, partition: str, n_groups: int, group_size: int, consumer: str, fields: Sequence[str]
    ) -> TakenBatch: ...

    async def set_version(self, version: int) -> None: ...

    async def take_evicted(self) -> list[str]: ...

    async def queued(self, partition: str) -> TakenBatch:
        """A copy of the whole groups waiting in ``partition`` (every trajectory field), left in
        place: what a checkpoint saves so that a resumed run trains them instead of generating
        them again."""
        ...

    async def resume_at(self, version: int) -> None:
        """A fresh queue for a run resumed at ``version``: every earlier step's samples count as
        accepted (and consumed), so admission continues where it stopped."""
        ...
