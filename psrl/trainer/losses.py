"""Token-level policy losses. Pure torch, no Megatron: each term is checked by hand in the tests.

Aggregation is expressed as per-token weights that sum to 1 over the whole (global) batch, so a
micro-batch's share is ``sum(loss_t * w_t)`` and the shares of all micro-batches and data-parallel
ranks add up to the batch loss:
- token_mean: ``w_t = m_t / (trained tokens in the batch)``
- seq_mean:   ``w_t = m_t / (trained tokens in t's sequence * sequences in the batch)``
Metrics use the same weights, so they are batch means too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from psrl.config import AlgorithmConfig

LOG_RATIO_LIMIT = 20.0  # exp() of a larger log-ratio overflows in float32 soon after


def aggregation_weights(
    mask: torch.Tensor, seq_tokens: torch.Tensor | None, mode: str, total_tokens: int, total_seqs: int
) -> torch.Tensor:
    """``seq_tokens``: per position, the number of trained tokens of that position's sequence
    (read by ``seq_mean`` only)."""
    if mode == "token_mean":
        return mask / max(total_tokens, 1)
    if mode == "seq_mean":
        return mask / (seq_tokens.clamp(min=1) * max(total_seqs, 1))
    raise ValueError(f"unknown loss aggregation {mode!r} (token_mean, seq_mean)")


def aggregate(values_B_T: torch.Tensor, mask_B_T: torch.Tensor, mode: str) -> torch.Tensor:
    """Aggregate a (sequences x tokens) tensor: the reference form of :func:`aggregation_weights`."""
    seq_tokens = mask_B_T.sum(-1, keepdim=True).expand_as(mask_B_T)
    total_seqs = int((mask_B_T.sum(-1) > 0).sum())
    w = aggregation_weights(mask_B_T, seq_tokens, mode, int(mask_B_T.sum()), total_seqs)
    return (values_B_T * w).sum()


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Estimators of KL(pi || pi_ref) from samples of pi (Schulman's k1, k2, k3)."""
    log_ratio = (logp - ref_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r} (k1, k2, k3)")


def behaviour_weights(prox_logp: torch.Tensor, behav_logp: torch.Tensor, cap: float | None, mode: str) -> torch.Tensor:
    """Importance weights pi_prox / pi_behav (no gradient), truncated at ``cap`` or masked above it."""
    w = torch.exp((prox_logp - behav_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)).detach()
    if cap is None:
        return w
    if mode == "truncate":
        return w.clamp(max=cap)
    if mode == "mask":
        return w * (w <= cap)
    raise ValueError(f"unknown truncated-IS mode {mode!r} (truncate, mask)")


@dataclass
class LossTerms:
    loss: torch.Tensor  # scalar: this slice's share of the batch loss
    metrics: dict[str, torch.Tensor]  # scalars, same weighting (detached)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    cfg: AlgorithmConfig,
    *,
    behav_weight: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> LossTerms:
    """PPO clip (asymmetric ``clip_ratio_low``/``high``) with dual clip for negative advantages.

    ``old_logp`` is the policy the ratio is taken against (the behaviour policy for ``ppo``, the
    proximal one for ``decoupled_ppo``); ``behav_weight`` multiplies each token's policy loss.
    """
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    pg = torch.maximum(pg1, pg2)
    clipped = (pg2 > pg1).float()
    dual = torch.zeros_like(pg)
    if cfg.dual_clip_c is not None:
        pg3 = -advantages * cfg.dual_clip_c
        negative = advantages < 0
        dual = (negative & (pg > pg3)).float()
        pg = torch.where(negative, torch.minimum(pg, pg3), pg)
    if behav_weight is not None:
        pg = pg * behav_weight
    total = pg
    w = weights
    d = lambda t: (t.detach() * w).sum()  # noqa: E731
    metrics = {
        "pg_loss": d(pg),
        "clip_frac": d(clipped),
        "dual_clip_frac": d(dual),
        "ratio": d(ratio),
        "approx_kl": d(0.5 * log_ratio.square()),  # to the policy the ratio is taken against
    }
    if behav_weight is not None:
        metrics["tis_weight"] = d(behav_weight)
    if ref_logp is not None and cfg.kl_coef > 0:
        kl = kl_penalty(logp, ref_logp, cfg.kl_estimator)
        total = total + cfg.kl_coef * kl
        metrics["kl"] = d(kl)
    if entropy is not None:
        if cfg.entropy_coef:
            total = total - cfg.entropy_coef * entropy
        metrics["entropy"] = d(entropy)
    loss = (total * w).sum()
    metrics["loss"] = loss.detach()
    return LossTerms(loss, metrics)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, weights: torch.Tensor,
               clip: float | None) -> LossTerms:
    """PPO's clipped value loss ``0.5 * max((V - R)^2, (V_clip - R)^2)`` with
    ``V_clip = V_old + clamp(V - V_old, -clip, clip)`` (``clip`` None: the plain squared error)."""
    err = (values - returns).square()
    if clip is not None:
        clipped_v = old_values + (values - old_values).clamp(-clip, clip)
        err_clip = (clipped_v - returns).square()
        per_token = 0.5 * torch.maximum(err, err_clip)
        clipped = (err_clip > err).float()
    else:
        per_token = 0.5 * err
        clipped = torch.zeros_like(err)
    d = lambda t: (t.detach() * weights).sum()  # noqa: E731
    loss = (per_token * weights).sum()
    return LossTerms(loss, {"value_loss": loss.detach(), "value_clip_frac": d(clipped), "value_pred_mean": d(values)})


def sft_loss(logp: torch.Tensor, hits: torch.Tensor, weights: torch.Tensor) -> LossTerms:
    """Cross-entropy ``-sum(w_t log p(target_t))`` with ``weights`` as in :func:`aggregation_weights`
    (token_mean over the batch's loss tokens); ``hits`` (1 where the greedy prediction is the
    target) gives ``token_acc`` under the same weights."""
    loss = -(logp * weights).sum()
    return LossTerms(loss, {"loss": loss.detach(), "token_acc": (hits.detach().float() * weights).sum()})
