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

# fp32 elements of one (tokens x local vocab) working chunk. CUDA: 16 M = 64 MB (the caching
# allocator reuses it). CPU: 2 M = 8 MB. glibc serves a block over its mmap ceiling (32 MB) with a
# fresh mapping every time, so a 64 MB chunk cost ~16k page faults per temporary; below the ceiling
# freed chunks are reused from the heap. Measured on SmolLM2's vocabulary (512 tokens, forward and
# backward): 310 ms at 16 M, 141 ms at 4 M, 64 ms at 2 M, 84-86 ms at 0.25-1 M.
_CHUNK_ELEMENTS = {"cuda": 1 << 24, "cpu": 1 << 21}


def _tp():
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1, None
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()


def _chunk_elements(device: torch.device) -> int:
    return _CHUNK_ELEMENTS.get(device.type, _CHUNK_ELEMENTS["cuda"])


def _chunks(n: int, v_local: int, device: torch.device):
    step = max(1, _chunk_elements(device) // max(v_local, 1))
    for s in range(0, max(n, 1), step):  # no tokens: one empty chunk, so results are empty tensors
        yield slice(s, min(n, s + step))


def _scaled(z: torch.Tensor, inv_t: float) -> torch.Tensor:
    """``z / T`` in fp32: ``z`` itself when nothing changes (never modified in place)."""
    z = z.float()
    return z if inv_t == 1.0 else z * inv_t


class _VocabParallelLogprobs(torch.autograd.Function):
    """(N, V/tp) logits, (N,) targets -> (N,) log p(target), (N,) entropy; both fp32.

    Saved for backward: the logits (which autograd holds anyway) and per-token scalars: log Z of
    the scaled logits and the entropy. Backward recomputes the softmax chunk by chunk, straight
    into the gradient's storage where the logits are fp32 (three passes over a chunk, no other
    (tokens x vocab) allocation)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, want_entropy: bool, reuse: bool):
        rank, size, group = _tp()
        n, v_local = logits.shape
        inv_t = 1.0 / temperature
        ctx.probs = False
        if (reuse and size == 1 and inv_t == 1.0 and logits.dtype == torch.float32 and ctx.needs_input_grad[0]
                and n * v_local <= _chunk_elements(logits.device)):
            # The caller gave up the logits: their storage takes the shifted logits, then the
            # entropy's products, and the softmax (the one the backward needs) is kept from here.
            logp, entropy, probs = _whole_vocab_reusing(logits.detach(), targets, want_entropy)
            ctx.save_for_backward(probs, targets)
            ctx.probs = True
            ctx.set_materialize_grads(False)
            ctx.mark_non_differentiable(entropy)
            return logp, entropy
        if size == 1:
            # One rank holds the whole vocabulary: every target is inside it (an id past the
            # vocabulary fails in ``gather``), so no masking, and one chunk (the usual case on a
            # micro-batch) needs no preallocated outputs: ~15 tensor ops a call instead of ~30.
            local, inside = targets, None
            parts = [_whole_vocab(_scaled(logits[sl], inv_t), local[sl], want_entropy) for sl in _chunks(n, v_local, logits.device)]
            log_z, logp, entropy = parts[0] if len(parts) == 1 else [
                None if parts[0][i] is None else torch.cat([p[i] for p in parts]) for i in range(3)
            ]
        else:
            local = targets - rank * v_local
            inside = (local >= 0) & (local < v_local)
            local = local.clamp(0, v_local - 1)
            # The max, the partition function, the target logit and E[z] are sums (maxima) of the
            # ranks' parts.
            m = torch.empty(n, dtype=torch.float32, device=logits.device)
            ez = torch.empty_like(m) if want_entropy else None  # sum of e^(z/T - max) (z/T - max)
            for sl in _chunks(n, v_local, logits.device):
                m[sl] = logits[sl].amax(-1).float() * inv_t
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            s = torch.empty_like(m)
            for sl in _chunks(n, v_local, logits.device):
                shifted = _scaled(logits[sl], inv_t).sub(m[sl, None])  # z/T - max: no cancellation below
                e = shifted.exp()
                s[sl] = e.sum(-1)
                if want_entropy:
                    ez[sl] = e.mul_(shifted).sum(-1)  # e is spent: the product in its storage
            zt = (logits.gather(-1, local[:, None])[:, 0].float() * inv_t - m) * inside
            parts = torch.stack([s, zt] + ([ez] if want_entropy else []))
            dist.all_reduce(parts, group=group)
            log_s = parts[0].log()
            logp = parts[1] - log_s
            log_z = m + log_s
            entropy = log_s - parts[2] / parts[0] if want_entropy else None  # H = log Z - E[z/T], both relative to the max
        if entropy is None:
            entropy = torch.zeros_like(logp)
        ctx.save_for_backward(logits, local, inside, log_z, entropy)
        ctx.inv_t = inv_t
        ctx.whole_vocab = size == 1  # log Z over this rank's logits alone
        ctx.set_materialize_grads(False)  # an unused output (a metric-only entropy) costs nothing
        ctx.mark_non_differentiable(*(() if want_entropy else (entropy,)))
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        if ctx.probs:
            probs, targets = ctx.saved_tensors
            if g_logp is None:
                return None, None, None, None, None
            # The gradient is written over the kept softmax: a second backward through this graph
            # (retain_graph) fails autograd's version check instead of reading it.
            grad = probs.mul_(-g_logp[:, None])  # -g p + g 1[j = t]
            return grad.scatter_add_(-1, targets[:, None], g_logp[:, None]), None, None, None, None
        logits, local, inside, log_z, entropy = ctx.saved_tensors
        inv_t = ctx.inv_t
        n, v_local = logits.shape
        in_place = logits.dtype == torch.float32
        one_hot = g_logp  # the 1[j = t] term's weight: none for a target on another rank's slice
        if g_logp is not None and inside is not None:
            one_hot = g_logp * inside
        if inv_t == 1.0 and g_ent is None and in_place and ctx.whole_vocab and g_logp is not None and n * v_local <= _chunk_elements(logits.device):
            # The usual micro-batch: p straight from the logits into a fresh gradient with the
            # softmax kernel's vectorized exp (torch's elementwise exp is ~2x slower on CPU), then
            # -g p + g 1[j = t]: three passes, four tensor ops.
            grad = torch.ops.aten._softmax(logits, -1, False).mul_(-g_logp[:, None])
            return grad.scatter_add_(-1, local[:, None], one_hot[:, None]), None, None, None, None
        grad = torch.empty_like(logits)
        for sl in _chunks(n, v_local, logits.device):
            # log p_j = z_j / T - log Z;  d logp_t / d (z_j/T) = 1[j = t] - p_j;
            # d H / d (z_j/T) = -p_j (log p_j + H)
            out = grad[sl] if in_place else None
            coef = -g_logp[sl, None] if g_logp is not None else 0.0
            if inv_t == 1.0 and g_ent is None and in_place and ctx.whole_vocab:
                # p straight from the logits into the gradient's storage in one pass.
                g = torch.ops.aten._softmax.out(logits[sl], -1, False, out=out).mul_(coef)
            else:
                if inv_t == 1.0:
                    logp_all = torch.sub(logits[sl], log_z[sl, None], out=out) if in_place else logits[sl].float() - log_z[sl, None]
                else:
                    logp_all = torch.mul(logits[sl], inv_t, out=out) if in_place else logits[sl].float() * inv_t
                    logp_all.sub_(log_z[sl, None])
                if g_ent is None:
                    g = logp_all.exp_().mul_(coef)
                else:
                    shifted = (logp_all + entropy[sl, None]).mul_(-g_ent[sl, None]).add_(coef)
                    g = logp_all.exp_().mul_(shifted)
            if g_logp is not None:
                g.scatter_add_(-1, local[sl, None], one_hot[sl, None].to(g.dtype))
            if inv_t != 1.0:
                g.mul_(inv_t)
            if not in_place:
                grad[sl] = g
        return grad, None, None, None, None


def _whole_vocab(z: torch.Tensor, targets: torch.Tensor, want_entropy: bool):
    """log Z, log p(target) and (if wanted) the entropy of (n, V) logits ``z`` (fp32, scaled)."""
    if not want_entropy:
        ls = torch.log_softmax(z, -1)
        return z[:, 0] - ls[:, 0], ls.gather(-1, targets[:, None])[:, 0], None
    # max p = e^(max - log Z) >= 1/V, so log Z - max = -log max p exactly enough; then
    # H = (log Z - max) - E[z - max], the expectation of the shifted logits (no cancellation
    # between two large numbers), summed in p's own storage. One softmax instead of a log-softmax
    # and a softmax. Against float64 (random logits, 512 x 832 and 64 x 49,152): largest error
    # 2e-5 (bmm of the shifted logits, as before: 1.5e-4, at 1.8x the time on CPU, where bmm of
    # these shapes is a batch of gemv; E[z] without the shift: 2e-4).
    m = z.amax(-1, keepdim=True)
    shifted = z - m
    p = torch.softmax(shifted, -1)
    rel = p.amax(-1).log_().neg_()  # log Z - max
    logp = shifted.gather(-1, targets[:, None])[:, 0].sub_(rel)
    return rel + m[:, 0], logp, rel - p.mul_(shifted).sum(-1)


def _whole_vocab_reusing(z: torch.Tensor, targets: torch.Tensor, want_entropy: bool):
    """log p(target), the entropy (zeros unless wanted) and the softmax of ``z`` (fp32, unscaled),
    as :func:`_whole_vocab` computes them but overwriting ``z``.
    The same operations on the same values (results equal bit for bit), one buffer fewer, and the
    backward then costs one pass instead of a softmax and a pass."""
    m = z.amax(-1, keepdim=True)
    shifted = z.sub_(m)
    p = torch.softmax(shifted, -1)
    rel = p.amax(-1).log_().neg_()  # log Z - max
    logp = shifted.gather(-1, targets[:, None])[:, 0].sub_(rel)
    if want_entropy:
        entropy = rel - torch.mul(p, shifted, out=shifted).sum(-1)
    else:
        entropy = torch.zeros_like(logp)
    return logp, entropy, p


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    reuse_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logits`` (..., V/tp) -> log p(target) (...) and, optionally, the entropy (...), in fp32.
    ``entropy_grad=False`` returns the entropy detached (it is then only a metric).

    ``reuse_logits=True``: the caller reads ``logits`` no more, so where it helps (one rank holds
    the vocabulary, fp32, temperature 1, one chunk, a metric-only entropy) their storage is
    overwritten and the forward keeps the softmax for the backward instead of the logits: the
    backward is then one pass over it (one backward only: a second fails autograd's check)."""
    shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    reuse = reuse_logits and not (with_entropy and entropy_grad)
    logp, entropy = _VocabParallelLogprobs.apply(flat, targets.reshape(-1), float(temperature), with_entropy, reuse)
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
    for sl in _chunks(n, v_local, logits.device):
        z = flat[sl].float()
        m[sl] = z.amax(-1)
        zt[sl] = z.gather(-1, local[sl, None])[:, 0]
    zt = torch.where(inside, zt, torch.full_like(zt, float("-inf")))
    if size > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(zt, op=dist.ReduceOp.MAX, group=group)
    return (zt >= m).float().view(shape)
