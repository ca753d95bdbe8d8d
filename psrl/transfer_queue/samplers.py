"""Samplers: which ready samples make the next batch.

A sampler is a small typed message: the client names it in ``get_meta`` and the controller runs
it over the candidates (ready, not yet taken by this consumer, in arrival order). ``select``
returns positions into the candidates in batch order, or ``None`` when no batch can be formed yet.
With ``partial=True`` it returns what it can now (possibly nothing) instead of waiting.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np


@dataclass(frozen=True)
class Candidates:
    """Parallel arrays, one entry per candidate sample, oldest first."""

    groups: np.ndarray  # int32 interned group ids
    seq_lens: np.ndarray  # int32

    def __len__(self) -> int:
        return len(self.groups)


class SequentialSampler(msgspec.Struct, frozen=True, tag="sequential"):
    """First in, first out."""

    def check(self, batch_size: int) -> None:
        _check_batch(batch_size)

    def select(self, cand: Candidates, batch_size: int, partial: bool) -> np.ndarray | None:
        if len(cand) < batch_size and not partial:
            return None
        return np.arange(min(batch_size, len(cand)))


class GRPOGroupSampler(msgspec.Struct, frozen=True, tag="grpo_group"):
    """Whole groups only: a group enters a batch once ``group_size`` of its samples are ready,
    oldest group first, its members together (advantages are computed within a group)."""

    group_size: int

    def check(self, batch_size: int) -> None:
        _check_batch(batch_size)
        if self.group_size < 1:
            raise ValueError(f"GRPOGroupSampler: group_size must be >= 1, got {self.group_size}")
        if batch_size % self.group_size:
            raise ValueError(f"GRPOGroupSampler: batch_size {batch_size} is not a multiple of group_size {self.group_size}")

    def select(self, cand: Candidates, batch_size: int, partial: bool) -> np.ndarray | None:
        want = batch_size // self.group_size
        if len(cand) < self.group_size:
            return np.zeros(0, np.int64) if partial else None
        uniq, first, counts = np.unique(cand.groups, return_index=True, return_counts=True)
        complete = counts >= self.group_size
        order = np.argsort(first[complete], kind="stable")[:want]
        chosen = uniq[complete][order]
        if len(chosen) < want and not partial:
            return None
        # Members of each chosen group, oldest first, group after group; a group that got more
        # than group_size samples contributes its oldest group_size.
        pos = np.flatnonzero(np.isin(cand.groups, chosen))
        rank = {int(g): i for i, g in enumerate(chosen)}
        per_group: list[list[int]] = [[] for _ in chosen]
        for p in pos:
            bucket = per_group[rank[int(cand.groups[p])]]
            if len(bucket) < self.group_size:
                bucket.append(int(p))
        return np.fromiter((p for b in per_group for p in b), np.int64, len(chosen) * self.group_size)


class SeqLenBalancedSampler(msgspec.Struct, frozen=True, tag="seqlen_balanced"):
    """Oldest ``batch_size`` samples, laid out as ``dp_size`` equal shares whose token totals are
    as even as a greedy longest-first assignment makes them. ``KVBatchMeta.split(dp_size)``
    recovers the shares."""

    dp_size: int

    def check(self, batch_size: int) -> None:
        _check_batch(batch_size)
        if self.dp_size < 1:
            raise ValueError(f"SeqLenBalancedSampler: dp_size must be >= 1, got {self.dp_size}")
        if batch_size % self.dp_size:
            raise ValueError(f"SeqLenBalancedSampler: batch_size {batch_size} is not a multiple of dp_size {self.dp_size}")

    def select(self, cand: Candidates, batch_size: int, partial: bool) -> np.ndarray | None:
        if len(cand) < batch_size and not partial:
            return None
        n = min(batch_size, len(cand)) // self.dp_size * self.dp_size
        if n == 0:
            return np.zeros(0, np.int64)
        return balance_by_length(cand.seq_lens[:n], self.dp_size)


def balance_by_length(seq_lens: np.ndarray, dp_size: int) -> np.ndarray:
    """Positions ``0..n-1`` reordered rank after rank; each rank gets ``n / dp_size`` of them.

    Longest first, each to the rank with the fewest tokens that still has room (LPT with a count
    limit): the largest share is within one sequence of the smallest.
    """
    n = len(seq_lens)
    per = n // dp_size
    loads = np.zeros(dp_size, np.int64)
    shares: list[list[int]] = [[] for _ in range(dp_size)]
    for p in np.argsort(-np.asarray(seq_lens, np.int64), kind="stable"):
        open_ranks = [r for r in range(dp_size) if len(shares[r]) < per]
        r = min(open_ranks, key=lambda r: loads[r])
        shares[r].append(int(p))
        loads[r] += int(seq_lens[p])
    return np.fromiter((p for s in shares for p in sorted(s)), np.int64, n)


Sampler = SequentialSampler | GRPOGroupSampler | SeqLenBalancedSampler

SAMPLER_NAMES = ("sequential", "grpo_group", "seqlen_balanced")


def make_sampler(name: str, *, group_size: int = 1, dp_size: int = 1) -> Sampler:
    """The sampler a config names (``TransferQueueConfig.sampler``)."""
    if name == "sequential":
        return SequentialSampler()
    if name == "grpo_group":
        return GRPOGroupSampler(group_size=group_size)
    if name == "seqlen_balanced":
        return SeqLenBalancedSampler(dp_size=dp_size)
    raise ValueError(f"unknown sampler {name!r}; known: {', '.join(SAMPLER_NAMES)}")


def _check_batch(batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
