"""PPO mini-batches: which samples go into which optimizer step of one batch.

``trainer.ppo_mini_batch_size`` counts groups (prompts), as veRL counts them. A batch of ``G``
groups gives ``ceil(G / size)`` mini-batches of whole groups (sizes differ by at most one group),
repeated ``trainer.ppo_epochs`` times (groups reshuffled per epoch after the first): one optimizer
step each. Every data-parallel rank takes the same number of steps:

- whole batch on every rank: each mini-batch is split over the ranks like a batch is;
- a rank holding its own share of whole groups (the Ray launcher): the number of mini-batches comes
  from the batch's total group count, and the rank splits its own groups into that many parts.

A rank may hold no sample of some mini-batch (few groups, many ranks): it then still takes part in
the step's collectives with a zero-weight micro-batch (see ``MegatronTrainer``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def groups_in_order(group_ids: Sequence[str]) -> list[list[int]]:
    """Member indices of each group, groups in order of first appearance."""
    out: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        out.setdefault(g, []).append(i)
    return list(out.values())


def count_mini_batches(num_groups: int, mini_batch_size: int | None) -> int:
    if num_groups < 1:
        raise ValueError("a batch without groups has no mini-batches")
    if mini_batch_size is None:
        return 1
    if mini_batch_size < 1:
        raise ValueError(f"trainer.ppo_mini_batch_size must be a positive number of groups, got {mini_batch_size}")
    if mini_batch_size > num_groups:
        raise ValueError(
            f"trainer.ppo_mini_batch_size={mini_batch_size} is larger than the batch ({num_groups} groups): "
            "a mini-batch counts groups (prompts), at most the batch's"
        )
    return math.ceil(num_groups / mini_batch_size)


def split_groups(groups: Sequence[Sequence[int]], parts: int) -> list[list[int]]:
    """``parts`` runs of consecutive groups, as even in group count as can be (some may be empty)."""
    bounds = np.linspace(0, len(groups), parts + 1).round().astype(int)
    return [[i for g in groups[a:b] for i in g] for a, b in zip(bounds[:-1], bounds[1:])]


def plan_mini_batches(
    group_ids: Sequence[str], *, mini_batch_size: int | None, epochs: int, seed: Sequence[int],
    total_groups: int | None = None,
) -> list[list[int]]:
    """Sample indices of each optimizer step (``epochs * mini-batches`` lists, some possibly empty
    on a rank's share). ``total_groups``: the batch's group count when ``group_ids`` is this rank's
    share of it (None: ``group_ids`` is the whole batch)."""
    groups = groups_in_order(group_ids)
    parts = count_mini_batches(total_groups if total_groups is not None else len(groups), mini_batch_size)
    if epochs < 1:
        raise ValueError(f"trainer.ppo_epochs must be >= 1, got {epochs}")
    steps: list[list[int]] = []
    for epoch in range(epochs):
        order = groups
        if epoch:  # same on every rank: seeded by the trainer seed and the step
            perm = np.random.default_rng([*seed, epoch]).permutation(len(groups))
            order = [groups[k] for k in perm]
        steps.extend(sorted(part) for part in split_groups(order, parts))
    return steps
