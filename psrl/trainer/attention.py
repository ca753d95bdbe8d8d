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

Sliding-window layers (Gemma 3: ``window`` W, a query sees the keys at distance < W, as
transformers' mask) take the same routes: varlen flash with ``window_size=(W - 1, 0)`` where
torch has it; otherwise a document no longer than W is plain causal, and a longer one attends in
blocks of W queries, each to its own block and the W - 1 keys before it, under one shared
(W, 2W - 1) band mask: memory stays linear in the tokens.

Heads arrive already split over tensor-parallel ranks; grouped-query attention is kept (key/value
heads are shared by ``heads / groups`` query heads and never copied on the fused paths).

Rotary position embedding is applied here too (the model is built without Megatron's): Megatron
recomputes cos and sin of every position in every layer and splits packed micro-batches per
document to do it; :class:`RotaryTable` builds the rows of one micro-batch once, in the first
layer, and the other layers reuse them (positions restart at every document).
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


class RotaryTable:
    """RoPE's cos and sin, shared by the layers of one model.

    ``inv_freq`` (head_dim / 2,) are the angular frequencies (scaling already applied). ``rows``
    returns (seq_len, 1, head_dim) cos and sin (the sine's first half negated, as
    ``apply_rotary`` takes it) for a packed micro-batch of ``seq_len`` tokens (positions restart at
    each document of ``cu_seqlens``, the longest ``max_seqlen``) or for ``seq_len`` positions from
    0; the last result is kept while the same micro-batch runs through the layers (keyed by its
    ``PackedSeqParams``). It reads nothing back from the device: on CUDA a host read of
    ``cu_seqlens`` would wait for the GPU to finish everything queued before it.
    """

    def __init__(self, inv_freq: Tensor) -> None:
        self.inv_freq = inv_freq.float()
        self._key: object = None
        self._rows: tuple[Tensor, Tensor] | None = None
        self._table: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor]] = {}

    def _cos_sin(self, n: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(>= n, D) cos and sin of positions 0.. (grown by doubling, kept per device and dtype)."""
        have = self._table.get((device, dtype))
        if have is None or have[0].shape[0] < n:
            size = max(n, 2 * have[0].shape[0] if have is not None else 1024)
            angles = torch.arange(size, device=device, dtype=torch.float32)[:, None] * self.inv_freq.to(device)[None, :]
            # The two halves rotate together; the sine's first half is negated for ``apply_rotary``.
            cos = torch.cat((angles, angles), dim=-1).cos()
            sin = torch.cat((-angles, angles), dim=-1).sin()
            have = self._table[(device, dtype)] = (cos.to(dtype), sin.to(dtype))
        return have

    def rows(self, key: object, device: torch.device, dtype: torch.dtype, *, seq_len: int,
             cu_seqlens: Tensor | None = None, max_seqlen: int = 0) -> tuple[Tensor, Tensor]:
        same = self._key is key or (isinstance(key, tuple) and key == self._key)
        if same and self._rows is not None and self._rows[0].device == device and self._rows[0].dtype == dtype:
            return self._rows
        if cu_seqlens is not None:
            cos, sin = self._cos_sin(max(max_seqlen, 1), device, dtype)
            bounds = cu_seqlens.to(device=device, dtype=torch.int64)
            starts = bounds[:-1]
            # output_size: the total is known, so nothing is read back to size the result
            doc_start = torch.repeat_interleave(starts, bounds[1:] - starts, output_size=seq_len)
            pos = torch.arange(seq_len, device=device) - doc_start
            rows = cos.index_select(0, pos), sin.index_select(0, pos)
        else:
            cos, sin = self._cos_sin(seq_len, device, dtype)
            rows = cos[:seq_len], sin[:seq_len]
        self._key, self._rows = key, (rows[0][:, None, :], rows[1][:, None, :])  # (T, 1, D)
        return self._rows


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x`` (..., D) rotated by position (non-interleaved halves, as Llama and Qwen2 store them).
    ``sin`` is ``RotaryTable``'s, first half negated: ``x * cos + [-x2, x1] * [sin, sin]`` is then
    ``x * cos + roll(x, D/2) * sin``, one op for the half swap where chunk, neg and cat took
    three (fwd+bwd of q (512, 2, 32): 244 -> 207 us on CPU, the same values to the bit)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def _sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float, gqa: bool, window: int | None = None) -> Tensor:
    """(batch, heads, tokens, dim) causal attention; with ``window``, each query sees only the keys
    at distance < ``window``."""
    n = q.shape[2]
    if window is None or n <= window:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return _sliding_sdpa(q, k, v, scale, gqa, window)


def _band(window: int, device: torch.device) -> Tensor:
    """(W, 2W - 1) bool: query a of a block sees key j of its span (the W - 1 keys before the
    block, then the block) when 0 <= (a + W - 1) - j < W. Built per call, not cached: a tensor
    made under ``inference_mode`` could not be saved for a later backward."""
    a = torch.arange(window, device=device)[:, None]
    j = torch.arange(2 * window - 1, device=device)[None, :]
    return (j >= a) & (j <= a + window - 1)


def _sliding_sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float, gqa: bool, window: int) -> Tensor:
    """:func:`_sdpa` with a window, for ``n`` > W tokens: the first W queries are plain causal
    (every key before them is within the window); the others go in blocks of W, block i (from 1)
    attending to keys [i W - (W - 1), (i + 1) W) under one band mask shared by every block. The
    last block is padded with zeros at the end: a real query never sees a key to its right, and
    the padded queries' outputs are dropped. Memory: ~2x keys and values, (W, 2W - 1) mask."""
    b, h, n, d = q.shape
    w = window
    first = F.scaled_dot_product_attention(q[:, :, :w], k[:, :, :w], v[:, :, :w], is_causal=True, scale=scale,
                                           enable_gqa=gqa)
    m = -(-(n - w) // w)  # blocks after the first
    pad = (m + 1) * w - n
    qb = F.pad(q[:, :, w:], (0, 0, 0, pad)).view(b, h, m, w, d).transpose(1, 2).reshape(b * m, h, w, d)

    def spans(t: Tensor) -> Tensor:  # (b, hk, n, d) -> (b m, hk, 2W - 1, d), keys from 1 on
        t = F.pad(t[:, :, 1:], (0, 0, 0, pad)).unfold(2, 2 * w - 1, w)  # (b, hk, m, d, 2W - 1)
        return t.permute(0, 2, 1, 4, 3).reshape(b * m, t.shape[1], 2 * w - 1, d)

    o = F.scaled_dot_product_attention(qb, spans(k), spans(v), attn_mask=_band(w, q.device), scale=scale, enable_gqa=gqa)
    rest = o.view(b, m, h, w, d).transpose(1, 2).reshape(b, h, m * w, d)[:, :, : n - w]
    return torch.cat((first, rest), dim=2)


def packed_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float,
                     window: int | None = None) -> Tensor:
    """``q`` (T, Hq, D), ``k``/``v`` (T, Hkv, D), documents at ``cu_seqlens`` -> (T, Hq, D).
    ``window``: sliding-window attention (a query sees the keys of its document at distance < W)."""
    gqa = q.shape[1] != k.shape[1]
    fused = _varlen() if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) else None
    if fused is not None and window is not None and "window_size" not in fused[1]:
        fused = None  # this torch's varlen_attn has no window
    if fused is not None and (fused[3] or math.isclose(scale, q.shape[-1] ** -0.5)):
        varlen_attn, causal, has_gqa, has_scale = fused
        if window is not None:
            causal = {"window_size": (window - 1, 0)}  # left W - 1: distance < W
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
            o = _sdpa(view(q), view(k), view(v), scale, gqa, window)  # (docs, H, n, D)
            outs.append(o.transpose(1, 2).reshape(e - s, q.shape[1], q.shape[2]))
        i = j
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class DocumentAttention(MegatronModule):
    """Core attention for Megatron-Core's ``SelfAttention`` (the ``core_attention`` submodule).

    Takes the constructor and forward arguments of ``DotProductAttention``; ignores
    ``attention_mask`` (the trainer passes none): causality and document bounds are the mask.
    ``window``: a sliding-window layer's window (a query sees the keys at distance < ``window``).
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, rope: RotaryTable | None = None,
                 window: int | None = None, **_unused):
        super().__init__(config=config)
        self.rope = rope
        if window is not None and window < 1:
            raise ValueError(f"attention window {window} must be at least 1")
        self.window = window
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
            if self.rope is not None:
                cos, sin = self.rope.rows(packed_seq_params, query.device, query.dtype, seq_len=query.shape[0],
                                          cu_seqlens=packed_seq_params.cu_seqlens_q,
                                          max_seqlen=int(packed_seq_params.max_seqlen_q))
                query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
            out = packed_attention(query, key, value, packed_seq_params.cu_seqlens_q,
                                   int(packed_seq_params.max_seqlen_q), self.scale, self.window)
            return out.reshape(out.shape[0], -1)  # (T, H*D); Megatron adds the batch dim back
        # sbhd: (S, B, H, D) -> (B, H, S, D)
        s, b = query.shape[:2]
        if self.rope is not None:
            cos, sin = self.rope.rows(("sbhd", s), query.device, query.dtype, seq_len=s)
            query, key = apply_rotary(query, cos[:, None], sin[:, None]), apply_rotary(key, cos[:, None], sin[:, None])
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        o = _sdpa(q, k, v, self.scale, self.heads != self.groups, self.window)
        return o.permute(2, 0, 1, 3).reshape(s, b, -1)
