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
    loss, stats = _ClippedSurrogate.apply(
        logp, old_logp.detach(), advantages.detach(), weights.detach(), cfg.clip_ratio_low, cfg.clip_ratio_high,
        cfg.dual_clip_c, None if behav_weight is None else behav_weight.detach(),
        None if entropy is None else entropy.detach(),
    )
    # approx_kl: to the policy the ratio is taken against
    names = ["pg_loss", "clip_frac", "dual_clip_frac", "ratio", "approx_kl"]
    names += ["tis_weight"] * (behav_weight is not None) + ["entropy"] * (entropy is not None)
    metrics = dict(zip(names, stats.unbind(), strict=True))
    if ref_logp is not None and cfg.kl_coef > 0:
        kl = kl_penalty(logp, ref_logp, cfg.kl_estimator)
        metrics["kl"] = (kl.detach() * weights).sum()
        loss = loss + cfg.kl_coef * (kl * weights).sum()
    if entropy is not None and cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * (entropy * weights).sum()
    metrics["loss"] = loss.detach()
    return LossTerms(loss, metrics)


class _ClippedSurrogate(torch.autograd.Function):
    """The clipped objective ``sum_t w_t pg_t`` (``pg`` times the behaviour weight when given)
    and its weighted metric sums, in one autograd node. PPO's ``pg = max(-A r, -A clip(r))`` is
    ``-min(A r, A clip(r))``; dual clip caps it at ``-A c`` where ``A < 0``. The forward keeps
    ``d pg / d log p`` per token (``-A r`` where neither clip nor the ``LOG_RATIO_LIMIT`` clamp
    applies, else 0) and the backward scales it: the same gradient as autograd through the
    elementwise form, which costs a node (~15 us on CPU) per elementwise op; this one is about half
    the time a micro-batch, forward and backward. At a tie between the two branches of a max or
    min (measure zero) the unclipped branch's slope counts whole, where autograd would halve it."""

    @staticmethod
    def forward(ctx, logp, old, adv, w, clip_low, clip_high, dual_c, behav, entropy):
        diff = logp.detach() - old
        log_ratio = diff.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        ratio = log_ratio.exp()
        a_r = adv * ratio
        a_clip = adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        clipped = a_clip < a_r
        obj = torch.minimum(a_r, a_clip)  # -pg
        flat = clipped | (log_ratio != diff)  # no slope: the clipped branch, or the log-ratio clamp
        dual = torch.zeros_like(clipped)
        if dual_c is not None:
            cap = adv * dual_c
            dual = (adv < 0) & (obj < cap)
            obj = torch.where(dual, cap, obj)
            flat |= dual
        slope = a_r.masked_fill_(flat, 0.0)  # -d pg / d log p
        rows = [obj, clipped.float(), dual.float(), ratio, log_ratio.square().mul_(0.5)]
        if behav is not None:
            obj = rows[0] = obj * behav
            slope.mul_(behav)
            rows.append(behav)
        if entropy is not None:
            rows.append(entropy)
        stats = torch.stack(rows).view(len(rows), -1).mv(w.reshape(-1))
        stats[0].neg_()  # sum w pg
        ctx.save_for_backward(slope, w)
        ctx.mark_non_differentiable(stats)
        return stats[0].clone(), stats

    @staticmethod
    def backward(ctx, g_loss, _g_stats):
        slope, w = ctx.saved_tensors
        return slope.mul(w).mul_(g_loss.neg()), None, None, None, None, None, None, None, None


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
