"""Outcome advantages, one per sample; every generated token of a sample gets its sample's value.

- grpo: reward minus the group mean, divided by the group's standard deviation (unbiased) when
  ``norm_by_std``. A group of one has advantage 0.
- rloo: reward minus the mean of the *other* samples of the group (leave-one-out baseline).
- reinforce_pp: REINFORCE++ -- rewards whitened over the whole batch (no per-group baseline).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

EPS = 1e-6


def _groups(group_ids: Sequence[str]) -> dict[str, np.ndarray]:
    out: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        out.setdefault(g, []).append(i)
    return {g: np.asarray(ix) for g, ix in out.items()}


def grpo_advantages(rewards_B: np.ndarray, group_ids: Sequence[str], norm_by_std: bool = True) -> np.ndarray:
    adv = np.zeros(len(rewards_B), np.float64)
    for ix in _groups(group_ids).values():
        r = rewards_B[ix].astype(np.float64)
        if len(r) < 2:
            continue
        a = r - r.mean()
        if norm_by_std:
            a = a / (r.std(ddof=1) + EPS)
        adv[ix] = a
    return adv.astype(np.float32)


def rloo_advantages(rewards_B: np.ndarray, group_ids: Sequence[str]) -> np.ndarray:
    adv = np.zeros(len(rewards_B), np.float64)
    for ix in _groups(group_ids).values():
        r = rewards_B[ix].astype(np.float64)
        n = len(r)
        if n < 2:
            continue
        adv[ix] = r - (r.sum() - r) / (n - 1)
    return adv.astype(np.float32)


def reinforce_pp_advantages(rewards_B: np.ndarray) -> np.ndarray:
    r = rewards_B.astype(np.float64)
    if len(r) < 2:
        return np.zeros(len(r), np.float32)
    return ((r - r.mean()) / (r.std() + EPS)).astype(np.float32)


def compute_advantages(rewards_B: np.ndarray, group_ids: Sequence[str], method: str, norm_by_std: bool = True) -> np.ndarray:
    rewards_B = np.asarray(rewards_B, np.float64)
    if len(rewards_B) != len(group_ids):
        raise ValueError(f"{len(rewards_B)} rewards for {len(group_ids)} group ids")
    if method == "grpo":
        return grpo_advantages(rewards_B, group_ids, norm_by_std)
    if method == "rloo":
        return rloo_advantages(rewards_B, group_ids)
    if method == "reinforce_pp":
        return reinforce_pp_advantages(rewards_B)
    raise ValueError(f"unknown advantage estimator {method!r} (grpo, rloo, reinforce_pp)")
