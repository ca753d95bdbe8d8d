"""Token log-probs and entropy from vocab-parallel logits, chunked over tokens.

With tensor parallelism each rank holds a slice of the vocabulary. The max, the partition function,
the target logit and the entropy's expectation are sums (or maxima) of per-rank parts all-reduced
over the tensor-parallel group; every rank then computes the same loss, so each rank's gradient is
the loss gradient with respect to its own logits slice (what Megatron's
``reduce_from_tensor_model_parallel_region`` gives: all-reduce forward, identity backward).

Memory: the forward keeps only per-token scalars (log Z, entropy) besides the logits autograd
already holds; softmax is recomputed chunk by chunk in backward. No (tokens x vocab) fp32 copy of
the micro-batch exists at any time, only one chunk of ``_CHUNK_ELEMENTS`` (profile in
``shared/gpu/README.md``: the full-vocab fp32 copies and casts were a large share of a step).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# fp32 elements of one (tokens x local vocab) working chunk: 16 M = 64 MB.
_CHUNK_ELEMENTS = 1 << 24


def _tp():
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1, None
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()


def _chunks(n: int, v_local: int):
    step = max(1, _CHUNK_ELEMENTS // max(v_local, 1))
    for s in range(0, n, step):
        yield slice(s, min(n, s + step))


def _f32(x: torch.Tensor) -> torch.Tensor:
    """A fresh fp32 copy (``.float()`` of an fp32 tensor is the tensor itself: no in-place on it)."""
    return x.to(torch.float32, copy=True)


class _VocabParallelLogprobs(torch.autograd.Function):
    """(N, V/tp) logits, (N,) targets -> (N,) log p(target), (N,) entropy; both fp32."""

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, want_entropy: bool):
        rank, size, group = _tp()
        n, v_local = logits.shape
        lo = rank * v_local
        local = targets - lo
        inside = (local >= 0) & (local < v_local)
        local = local.clamp(0, v_local - 1)
        inv_t = 1.0 / temperature
        m = torch.empty(n, dtype=torch.float32, device=logits.device)
        zt = torch.empty_like(m)
        for sl in _chunks(n, v_local):
            z = logits[sl].float()
            m[sl] = z.amax(-1) * inv_t
            zt[sl] = z.gather(-1, local[sl, None])[:, 0] * inv_t
        if size > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        s = torch.empty_like(m)
        ez = torch.empty_like(m) if want_entropy else None
        for sl in _chunks(n, v_local):
            z = _f32(logits[sl]).mul_(inv_t).sub_(m[sl, None])  # s - max, fp32 chunk
            e = z.exp()
            s[sl] = e.sum(-1)
            if want_entropy:
                ez[sl] = (e * z).sum(-1)
        zt = (zt - m) * inside
        if size > 1:
            parts = [s, zt] + ([ez] if want_entropy else [])
            packed = torch.stack(parts)
            dist.all_reduce(packed, group=group)
            s, zt = packed[0], packed[1]
            if want_entropy:
                ez = packed[2]
        log_z = s.log()  # of exp(s - max)
        logp = zt - log_z
        entropy = log_z - ez / s if want_entropy else torch.zeros_like(logp)
        ctx.save_for_backward(logits, local, inside, m, log_z, entropy)
        ctx.inv_t = inv_t
        ctx.set_materialize_grads(False)  # an unused output (a metric-only entropy) costs nothing
        ctx.mark_non_differentiable(*(() if want_entropy else (entropy,)))
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, local, inside, m, log_z, entropy = ctx.saved_tensors
        inv_t = ctx.inv_t
        n, v_local = logits.shape
        grad = torch.empty_like(logits)
        for sl in _chunks(n, v_local):
            logp_all = _f32(logits[sl]).mul_(inv_t).sub_(m[sl, None]).sub_(log_z[sl, None])
            p = logp_all.exp()
            # d logp_t / d s_j = 1[j = t] - p_j;  d H / d s_j = -p_j (log p_j + H)
            coef = -g_logp[sl, None] if g_logp is not None else 0.0
            if g_ent is not None:
                g = p * (coef - g_ent[sl, None] * (logp_all + entropy[sl, None]))
            else:
                g = p * coef
            if g_logp is not None:
                g.scatter_add_(-1, local[sl, None], (g_logp[sl] * inside[sl])[:, None].to(g.dtype))
            grad[sl] = g.mul_(inv_t)
        return grad, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logits`` (..., V/tp) -> log p(target) (...) and, optionally, the entropy (...), in fp32.
    ``entropy_grad=False`` returns the entropy detached (it is then only a metric)."""
    shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    logp, entropy = _VocabParallelLogprobs.apply(flat, targets.reshape(-1), float(temperature), with_entropy)
    logp = logp.view(shape)
    if not with_entropy:
        return logp, None
    entropy = entropy.view(shape)
    return logp, entropy if entropy_grad else entropy.detach()


@torch.no_grad()
def vocab_parallel_argmax_hits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``logits`` (..., V/tp) -> (...) float: 1 where the target has the largest logit (a tie
    counts as a hit), reduced over the tensor-parallel group like the log-probs."""
    rank, size, group = _tp()
    shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    n, v_local = flat.shape
    local = targets.reshape(-1) - rank * v_local
    inside = (local >= 0) & (local < v_local)
    local = local.clamp(0, v_local - 1)
    m = torch.empty(n, dtype=torch.float32, device=flat.device)
    zt = torch.empty_like(m)
    for sl in _chunks(n, v_local):
        z = flat[sl].float()
        m[sl] = z.amax(-1)
        zt[sl] = z.gather(-1, local[sl, None])[:, 0]
    zt = torch.where(inside, zt, torch.full_like(zt, float("-inf")))
    if size > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(zt, op=dist.ReduceOp.MAX, group=group)
    return (zt >= m).float().view(shape)
