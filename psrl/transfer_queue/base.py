"""The seam: what a transfer queue offers producers and consumers.

``TransferQueueClient`` implements it over ZeroMQ; ``psrl.testing.check_transfer_queue`` checks
any implementation against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import pyarrow as pa

from psrl.trajectory import Trajectory

from .columns import Puttable, Tags
from .meta import KVBatchMeta, QueueStatistics, Refill, RestoreReport, SampleInfo
from .samplers import Sampler


@runtime_checkable
class TransferQueue(Protocol):
    # producers
    async def put(self, trajectory: Trajectory, *, partition: str = "train", tags: Tags = None) -> None: ...
    async def put_nowait(self, trajectory: Trajectory, *, partition: str = "train", tags: Tags = None) -> None: ...
    async def batch_put(self, data: Puttable, *, partition: str = "train", tags: Tags = None) -> None: ...
    async def batch_put_nowait(self, data: Puttable, *, partition: str = "train", tags: Tags = None) -> None: ...
    async def put_fields(self, keys: Sequence[str], fields: dict, *, partition: str = "train") -> None: ...

    # consumers
    async def get_meta(
        self,
        partition: str,
        batch_size: int,
        fields: Sequence[str] | None = None,
        consumer: str = "trainer",
        sampler: Sampler | str = "sequential",
        *,
        partial: bool = False,
    ) -> KVBatchMeta: ...
    async def get_data(self, meta: KVBatchMeta, fields: Sequence[str] | None = None) -> pa.RecordBatch: ...
    async def get_batch(
        self,
        partition: str,
        batch_size: int,
        fields: Sequence[str] | None = None,
        consumer: str = "trainer",
        sampler: Sampler | str = "sequential",
        *,
        partial: bool = False,
    ) -> tuple[KVBatchMeta, pa.RecordBatch]: ...
    async def get_trajectories(self, meta: KVBatchMeta) -> list[Trajectory]: ...

    # bookkeeping
    async def list(self, partition: str | None = None) -> list[SampleInfo]: ...
    async def clear(self, partition: str | None = None, keys: Sequence[str] | None = None) -> int: ...
    async def statistics(self) -> QueueStatistics: ...

    # staleness
    async def set_version(self, version: int) -> None: ...
    async def acquire_rollouts(self, n: int) -> int: ...
    async def finish_rollouts(self, accepted: int, rejected: int = 0) -> None: ...
    async def take_refills(self, max_items: int = 1024) -> list[Refill]: ...

    # checkpoint
    async def checkpoint(self, path: str, *, with_data: bool = True) -> int: ...
    async def restore(self, path: str) -> RestoreReport: ...
