"""Per-rank batch shards: the driver plans, from scalar columns only, which samples each
data-parallel rank trains on; the ranks fetch their shares from the transfer queue themselves.

Groups stay whole within a share (advantages are per group), and advantages are computed once
over the whole step from rewards (a scalar), so every estimator, batch-wide ones included, gives
what a single rank holding the whole batch would compute.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

# The scalar columns the driver needs to plan shards (beside the metric ones).
SHARD_FIELDS: tuple[str, ...] = ("key", "group_id", "reward", "status", "loss_tokens", "prompt_length", "response_length")


@dataclass(frozen=True)
class ShardPlan:
    """``rows[r]``: positions in the step's batch that data-parallel rank ``r`` trains on."""

    rows: list[list[int]]
    advantages: list[np.ndarray]  # per share, aligned with ``rows[r]``
    total_tokens: int
    total_seqs: int


def plan_shards(batch: pa.RecordBatch, dp: int, *, advantage: str, norm_by_std: bool) -> ShardPlan:
    """Whole groups to ``dp`` shares, longest (in tokens) first, each to the lightest share."""
    from psrl.trainer.advantages import compute_advantages

    groups = batch.column("group_id").to_pylist()
    tokens = (np.asarray(batch.column("prompt_length").to_numpy(zero_copy_only=False), np.int64)
              + np.asarray(batch.column("response_length").to_numpy(zero_copy_only=False), np.int64))
    loss_tokens = np.asarray(batch.column("loss_tokens").to_numpy(zero_copy_only=False), np.int64)
    rewards = np.asarray(batch.column("reward").to_numpy(zero_copy_only=False), np.float64)
    members: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    if len(members) < dp:
        raise ValueError(
            f"a step of {len(members)} groups cannot give each of {dp} data-parallel ranks a whole group: "
            "raise data.batch_size to at least trainer.parallel.data"
        )
    load = np.zeros(dp, np.int64)
    shares: list[list[int]] = [[] for _ in range(dp)]
    by_size = sorted(members.values(), key=lambda ix: (-int(tokens[ix].sum()), ix[0]))
    for ix in by_size:
        r = int(np.argmin(load))
        shares[r].extend(ix)
        load[r] += int(tokens[ix].sum())
    rows = [sorted(s) for s in shares]
    # GAE's advantages need the critic's values: the ranks compute them (zeros here).
    adv = np.zeros(len(rewards), np.float32) if advantage == "gae" else compute_advantages(rewards, groups, advantage, norm_by_std)
    return ShardPlan(rows, [adv[r] for r in rows], int(loss_tokens.sum()), int(np.count_nonzero(loss_tokens)))


_SUMS = ("samples", "micro_batches", "loss_tokens", "tokens")  # optimizer_steps: equal on every rank
_BY_SAMPLES = ("reward_mean", "adv_mean", "adv_abs_mean", "response_len_mean")


def merge_share_metrics(per_share: Sequence[Mapping[str, float]], rewards: np.ndarray) -> dict[str, float]:
    """One step's trainer metrics from each share's: counts summed, batch means weighted, maxima
    maxed; loss metrics are already reduced over data-parallel ranks (identical everywhere)."""
    out = dict(per_share[0])
    n = np.array([m["samples"] for m in per_share], np.float64)
    tok = np.array([m["loss_tokens"] for m in per_share], np.float64)
    for k in _SUMS:
        out[k] = float(sum(m[k] for m in per_share))
    for k in _BY_SAMPLES:
        out[k] = float(np.dot(n, [m[k] for m in per_share]) / max(n.sum(), 1.0))
    out["staleness_mean"] = float(np.dot(tok, [m["staleness_mean"] for m in per_share]) / max(tok.sum(), 1.0))
    out["staleness_max"] = float(max(m["staleness_max"] for m in per_share))
    out["reward_std"] = float(rewards.std()) if len(rewards) else 0.0
    out["step_s"] = float(max(m["step_s"] for m in per_share))
    out["tokens_per_s"] = out["tokens"] / out["step_s"] if out["step_s"] > 0 else 0.0
    return out
