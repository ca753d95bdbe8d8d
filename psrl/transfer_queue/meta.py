"""What the controller hands out: metadata only, never tensors.

``KVBatchMeta`` is columnar (one list per attribute, aligned with ``keys``) so a 1,024-sample
batch is a handful of lists on the wire rather than 1,024 small objects.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec


class KVBatchMeta(msgspec.Struct, frozen=True, kw_only=True):
    """A batch chosen by ``get_meta``: which samples, which fields, where they live.

    ``tags[i]`` holds ``status`` plus the user tags given at put time. ``units[i]`` is the storage
    unit holding sample ``i``. ``min_versions[i]`` is the oldest policy version among its generated
    tokens (-1 when it has none). When a sampler balanced the batch across ``dp_size``
    data-parallel ranks, ``split(dp_size)[r]`` is rank ``r``'s share.
    """

    partition: str
    consumer: str
    fields: list[str]
    keys: list[str]
    group_ids: list[str]
    seq_lens: list[int]
    min_versions: list[int]
    units: list[int]
    tags: list[dict[str, str]]
    dp_size: int = 1

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def size(self) -> int:
        return len(self.keys)

    def select(self, indices: Sequence[int]) -> KVBatchMeta:
        idx = list(indices)
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        return KVBatchMeta(
            partition=self.partition, consumer=self.consumer, fields=list(self.fields),
            keys=pick(self.keys), group_ids=pick(self.group_ids), seq_lens=pick(self.seq_lens),
            min_versions=pick(self.min_versions), units=pick(self.units), tags=pick(self.tags),
        )

    def split(self, n: int) -> list[KVBatchMeta]:
        """``n`` contiguous equal shares (the layout the seq-len balanced sampler produces)."""
        if n < 1 or len(self) % n:
            raise ValueError(f"cannot split a batch of {len(self)} samples into {n} equal shares")
        per = len(self) // n
        return [self.select(range(r * per, (r + 1) * per)) for r in range(n)]

    def total_tokens(self) -> int:
        return sum(self.seq_lens)


class SampleInfo(msgspec.Struct, frozen=True):
    key: str
    partition: str
    group_id: str
    unit: int
    ready_fields: list[str]
    consumed_by: list[str]


class Refill(msgspec.Struct, frozen=True):
    """A group evicted as stale under ``on_stale='refill'``: the rollout side should generate
    these prompts again with the current policy."""

    partition: str
    group_id: str
    keys: list[str]


class RestoreReport(msgspec.Struct, frozen=True):
    samples: int
    with_data: bool
    version: int
    consumers: list[str]


class QueueStatistics(msgspec.Struct, frozen=True):
    samples: int  # live samples (reserved or holding data)
    ready_by_partition: dict[str, int]
    capacity_samples: int
    version: int
    max_staleness: int
    dropped_stale: int
    pending_refills: int
    accepted: int
    running: int
    admission_capacity: int
    unit_samples: list[int]
    consumers: list[str]
