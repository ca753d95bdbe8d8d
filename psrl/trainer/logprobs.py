"""Token log-probs and entropy from vocab-parallel logits.

With tensor parallelism each rank holds a slice of the vocabulary. The max is all-reduced without
gradient; the partition function, the target logit and the entropy's expectation are sums of
per-rank parts reduced with Megatron's ``reduce_from_tensor_model_parallel_region`` (all-reduce
forward, identity backward), which is the right gradient because every rank computes the same loss.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def _tp():
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1, None
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logits`` (..., V/tp) -> log p(target) (...) and, optionally, the entropy (...), in fp32.
    ``entropy_grad=False`` returns the entropy detached."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as reduce_tp

    rank, size, group = _tp()
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    m = z.detach().amax(dim=-1)
    if size > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    z = z - m.unsqueeze(-1)
    e = z.exp()
    s = e.sum(-1)
    v_local = z.shape[-1]
    local = targets - rank * v_local
    inside = (local >= 0) & (local < v_local)
    zt = z.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1) * inside
    if size > 1:
        s, zt = reduce_tp(s), reduce_tp(zt)
    log_z = s.log()
    logp = zt - log_z
    if not with_entropy:
        return logp, None
    # Entropy is usually only a metric: then it stays out of the autograd graph (no [T, V] saved).
    with contextlib.nullcontext() if entropy_grad else torch.no_grad():
        ez = (e * z).sum(-1)
        if size > 1:
            ez = reduce_tp(ez)
        entropy = log_z - ez / s
    return logp, entropy
