"""Causal self-attention over packed documents with no (T, T) tensor: Megatron-Core's core attention.

``DocumentAttention`` replaces Megatron's ``DotProductAttention`` in the layer spec. That one
materialises the full score matrix and needs a dense (T, T) block-diagonal mask for packed
micro-batches, which made attention ~45% of a GPU step and memory quadratic in the tokens of a
micro-batch (profile in ``shared/gpu/README.md``). Here:

- packed micro-batches arrive in Megatron's ``thd`` layout (tokens, heads, dim) with
  ``PackedSeqParams.cu_seqlens_q``; each document attends causally to itself only;
- padded micro-batches (``sbhd``, right padding) need only a causal mask: a real token never looks
  to its right, so the padding is never seen and no mask tensor is built.

Kernels, chosen by device and dtype (the same module on every device):
- CUDA, bf16/fp16 and ``torch.nn.attention.varlen.varlen_attn`` present: one fused flash call over
  the whole packed micro-batch;
- otherwise (CPU, fp32): ``scaled_dot_product_attention(is_causal=True)`` per document (runs of
  equal-length documents as one batch). PyTorch's fused CPU kernel then builds no (T, T) mask.

Heads arrive already split over tensor-parallel ranks; grouped-query attention is kept (key/value
heads are shared by ``heads / groups`` query heads and never copied on the fused paths).
"""

from __future__ import annotations

import inspect
import math
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide


@lru_cache(maxsize=1)
def _varlen():
    """(varlen_attn, its causal keyword, whether it takes ``enable_gqa``, whether it takes ``scale``)
    or None where it does not exist. Its arguments changed between torch releases."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    # torch <= 2.11 spells causality ``is_causal``; later versions use a window (-1, 0).
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return varlen_attn, causal, "enable_gqa" in params, "scale" in params


def _sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float, gqa: bool) -> Tensor:
    """(batch, heads, tokens, dim) causal attention."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)


def packed_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float) -> Tensor:
    """``q`` (T, Hq, D), ``k``/``v`` (T, Hkv, D), documents at ``cu_seqlens`` -> (T, Hq, D)."""
    gqa = q.shape[1] != k.shape[1]
    fused = _varlen() if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) else None
    if fused is not None and (fused[3] or math.isclose(scale, q.shape[-1] ** -0.5)):
        varlen_attn, causal, has_gqa, has_scale = fused
        if gqa and not has_gqa:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        extra = {"enable_gqa": True} if gqa and has_gqa else {}
        if has_scale:
            extra["scale"] = scale
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **causal, **extra)
    bounds = cu_seqlens.tolist()
    # Consecutive documents of one length share one SDPA call through a view (no gather: the
    # backward of index_select is a scatter-add that cost more than the attention itself on CPU,
    # bench trainer). The planner packs longest first, so equal lengths sit next to each other.
    outs = []
    i = 0
    while i < len(bounds) - 1:
        n = bounds[i + 1] - bounds[i]
        j = i + 1
        while j < len(bounds) - 1 and bounds[j + 1] - bounds[j] == n:
            j += 1
        s, e = bounds[i], bounds[j]
        if e > s:
            view = lambda t: t[s:e].view(j - i, n, t.shape[1], t.shape[2]).transpose(1, 2)  # noqa: E731
            o = _sdpa(view(q), view(k), view(v), scale, gqa)  # (docs, H, n, D)
            outs.append(o.transpose(1, 2).reshape(e - s, q.shape[1], q.shape[2]))
        i = j
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class DocumentAttention(MegatronModule):
    """Core attention for Megatron-Core's ``SelfAttention`` (the ``core_attention`` submodule).

    Takes the constructor and forward arguments of ``DotProductAttention``; ignores
    ``attention_mask`` (the trainer passes none): causality and document bounds are the mask.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, **_unused):
        super().__init__(config=config)
        from megatron.core.process_groups_config import ProcessGroupCollection

        if config.context_parallel_size != 1:
            raise ValueError("DocumentAttention does not support context parallelism")
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) != 0:
            raise ValueError("DocumentAttention has no attention dropout (RL fine-tuning uses none)")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type=None, attention_bias: Tensor | None = None, packed_seq_params=None) -> Tensor:
        if attention_bias is not None:
            raise ValueError("DocumentAttention takes no attention bias")
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed sequences must use the thd layout, got {packed_seq_params.qkv_format!r}")
            out = packed_attention(query, key, value, packed_seq_params.cu_seqlens_q,
                                   int(packed_seq_params.max_seqlen_q), self.scale)
            return out.reshape(out.shape[0], -1)  # (T, H*D); Megatron adds the batch dim back
        # sbhd: (S, B, H, D) -> (B, H, S, D)
        s, b = query.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        o = _sdpa(q, k, v, self.scale, self.heads != self.groups)
        return o.permute(2, 0, 1, 3).reshape(s, b, -1)
