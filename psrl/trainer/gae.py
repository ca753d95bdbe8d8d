"""Generalized advantage estimation (``algorithm.advantage=gae``) over a response's trained tokens.

Only tokens with loss mask 1 (what the model generated) are steps of the estimate: observation
(tool-output) tokens are skipped, so the value after a model turn is bootstrapped from the value at
the model's next token, across the observation between them. Along those ``n`` steps:

    delta_k = r_k + gamma * V_{k+1} - V_k        (V_{n+1} = 0: the episode ends)
    A_k     = delta_k + gamma * lam * A_{k+1}
    R_k     = A_k + V_k                           (the critic's target)

Rewards (:func:`token_rewards`): the episode's reward on the last trained token; with
``turn_rewards`` and per-turn rewards present, each turn's reward on that turn's last trained token
and what the episode's reward adds beyond their sum on the last trained token.
Pure numpy: every value is checked by hand in the tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

EPS = 1e-6


def token_rewards(
    loss_mask: np.ndarray, reward: float, turn_bounds: np.ndarray | None = None,
    turn_rewards: np.ndarray | None = None, *, use_turns: bool = False,
) -> np.ndarray:
    """Response-aligned rewards (float64), zero except at the tokens described above."""
    mask = np.asarray(loss_mask).astype(bool)
    out = np.zeros(len(mask), np.float64)
    trained = np.flatnonzero(mask)
    if not len(trained):
        return out
    rest = float(reward)
    if use_turns and turn_rewards is not None and len(turn_rewards):
        bounds = np.asarray(turn_bounds).reshape(-1, 2)
        for (start, end), r in zip(bounds, np.asarray(turn_rewards, np.float64)):
            inside = trained[(trained >= start) & (trained < end)]
            # A turn without a trained token: its reward goes to the next trained token.
            after = trained[trained >= start]
            at = inside[-1] if len(inside) else (after[0] if len(after) else trained[-1])
            out[at] += r
            rest -= r
    out[trained[-1]] += rest
    return out


def gae(rewards: np.ndarray, values: np.ndarray, loss_mask: np.ndarray, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Advantages and returns of one response (response-aligned, 0 where the loss mask is 0)."""
    mask = np.asarray(loss_mask).astype(bool)
    if not (len(rewards) == len(values) == len(mask)):
        raise ValueError(f"gae: {len(rewards)} rewards, {len(values)} values, {len(mask)} mask entries")
    steps = np.flatnonzero(mask)
    r = np.asarray(rewards, np.float64)[steps]
    v = np.asarray(values, np.float64)[steps]
    adv = np.zeros(len(steps), np.float64)
    running, next_v = 0.0, 0.0
    for k in range(len(steps) - 1, -1, -1):
        delta = r[k] + gamma * next_v - v[k]
        running = delta + gamma * lam * running
        adv[k] = running
        next_v = v[k]
    advantages = np.zeros(len(mask), np.float64)
    returns = np.zeros(len(mask), np.float64)
    advantages[steps] = adv
    returns[steps] = adv + v
    return advantages, returns


def whiten_stats(advantages: Sequence[np.ndarray], masks: Sequence[np.ndarray]) -> np.ndarray:
    """(count, sum, sum of squares) of the advantages on trained tokens: summed over data-parallel
    ranks, they give the batch's mean and std for :func:`whiten`."""
    vals = np.concatenate([a[np.asarray(m).astype(bool)] for a, m in zip(advantages, masks)] or [np.zeros(0)])
    return np.array([len(vals), vals.sum(), np.square(vals).sum()], np.float64)


def whiten(adv: np.ndarray, mask: np.ndarray, stats: np.ndarray, scale: bool = True) -> np.ndarray:
    """``(adv - mean) / std`` (or ``adv - mean``) on trained tokens, 0 elsewhere."""
    n, s, ss = (float(x) for x in stats)
    mean = s / max(n, 1.0)
    std = float(np.sqrt(max(ss / max(n, 1.0) - mean * mean, 0.0)))
    out = adv - mean
    if scale:
        out = out / (std + EPS)
    return (out * np.asarray(mask).astype(bool)).astype(np.float32)
