"""Gemma 3 (HF ``gemma3_text``) on Megatron-Core's local layers: what the family adds to a Llama-style
decoder, as transformers' ``modeling_gemma3.py`` computes it.

- Every RMSNorm (the four of a layer, the q/k norms, the final one) is ``x^ (1 + w)`` in float32:
  :class:`Gemma3RMSNorm`, whose parameter is the checkpoint's ``w`` unchanged (loads and exports
  need no offset).
- Sandwich norms: attention -> ``post_attention_layernorm`` -> residual add, and MLP ->
  ``post_mlp_layernorm`` (HF ``post_feedforward_layernorm``) -> residual add
  (:class:`Gemma3TransformerLayer`). The pre-MLP norm is Megatron's ``pre_mlp_layernorm`` (HF
  ``pre_feedforward_layernorm``).
- Layers alternate sliding-window and full attention, each type with its own RoPE base: one
  layer spec per type (``model.layer_spec``), sliced per pipeline stage by
  :func:`decoder_block_spec`.
- The embedding is multiplied by sqrt(hidden) in the weight's dtype (:func:`scale_embeddings`);
  the output layer is the tied, unscaled embedding.

The attention scale 1/sqrt(query_pre_attn_scalar) and the gelu-tanh gated MLP are plain
``TransformerConfig`` settings (``model.transformer_config``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import partial
from typing import TYPE_CHECKING

import torch

from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from .norm import rms_norm_plus_one

if TYPE_CHECKING:
    from .model import HFArch

LAYER_TYPES = ("sliding_attention", "full_attention")


class Gemma3RMSNorm(torch.nn.Module):
    """Gemma's RMSNorm with Megatron's norm constructor (``config, hidden_size, eps``). The weight
    stays float32 like the ``torch.nn.RMSNorm`` of Megatron's local spec; the result has the
    input's dtype."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        # Megatron all-reduces the gradients of norms tagged so over tensor-parallel ranks.
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_plus_one(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


@dataclass
class Gemma3LayerSubmodules(TransformerLayerSubmodules):
    post_attention_layernorm: ModuleSpec | type = field(default=Gemma3RMSNorm)
    post_mlp_layernorm: ModuleSpec | type = field(default=Gemma3RMSNorm)


def _normed_bda(norm, bda, training: bool, fused: bool):
    """Megatron's ``bias_dropout_add`` factory ``bda``, with the branch output normed before the
    add: ``residual + norm(out + bias)``."""
    add = bda(training, fused)

    def run(out_with_bias, residual, prob):
        out, bias = out_with_bias
        return add((norm(out if bias is None else out + bias), None), residual, prob)

    return run


class Gemma3TransformerLayer(TransformerLayer):
    """Megatron's ``TransformerLayer`` with Gemma's post-attention and post-MLP norms. They are
    applied inside the layer's bias-dropout-add steps, so its forward (recompute, offloading, the
    tensor-parallel linears) stays Megatron's own."""

    def __init__(self, config, submodules: Gemma3LayerSubmodules, layer_number: int = 1, hidden_dropout=None,
                 pg_collection=None, vp_stage=None):
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         hidden_dropout=hidden_dropout, pg_collection=pg_collection, vp_stage=vp_stage)
        if config.inference_fuse_tp_communication:
            raise ValueError("Gemma 3 layers do not support inference_fuse_tp_communication (it skips the bias-dropout-add)")
        norm = dict(config=self.config, hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon)
        self.post_attention_layernorm = build_module(submodules.post_attention_layernorm, **norm)
        self.post_mlp_layernorm = build_module(submodules.post_mlp_layernorm, **norm)
        self.self_attn_bda = partial(_normed_bda, self.post_attention_layernorm, self.self_attn_bda)
        self.mlp_bda = partial(_normed_bda, self.post_mlp_layernorm, self.mlp_bda)


def gemma3_layer_spec(spec: ModuleSpec) -> ModuleSpec:
    """Megatron's local layer spec ``spec`` (q/k norms on) turned into Gemma's: its layer class,
    Gemma's norm everywhere, the two post norms."""
    s = spec.submodules
    attn = s.self_attention.submodules
    attn.q_layernorm = attn.k_layernorm = Gemma3RMSNorm
    inherited = {f.name: getattr(s, f.name) for f in fields(TransformerLayerSubmodules)}
    inherited.update(input_layernorm=Gemma3RMSNorm, pre_mlp_layernorm=Gemma3RMSNorm)
    return ModuleSpec(module=Gemma3TransformerLayer, params=dict(spec.params),
                      submodules=Gemma3LayerSubmodules(**inherited))


def decoder_block_spec(arch: HFArch, config, specs: dict[str, ModuleSpec], pp_rank: int | None = None):
    """The block spec of a pipeline stage's layers (``pp_rank`` None: this process's stage): each
    layer the spec of its type in ``specs`` (keyed by ``arch.layer_types``' values), then Gemma's
    final norm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if len(arch.layer_types) != arch.num_layers or not set(arch.layer_types) <= set(LAYER_TYPES):
        raise ValueError(f"Gemma 3 layer_types must give one of {LAYER_TYPES} per layer ({arch.num_layers}), "
                         f"got {list(arch.layer_types)}")
    offset = get_transformer_layer_offset(config, pp_rank=pp_rank)
    n = get_num_layers_to_build(config, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[specs[t] for t in arch.layer_types[offset:offset + n]],
                                      layer_norm=Gemma3RMSNorm)


def _scale_hook(module, args, output):
    return output * module.psrl_embed_scale


def scale_embeddings(model, hidden_size: int) -> None:
    """Multiply ``model``'s (a GPTModel's, first stage) word embeddings by sqrt(hidden_size), the
    factor rounded to the weight's dtype first as transformers does (bf16: sqrt(3072) is 55.5)."""
    emb = model.embedding.word_embeddings
    emb.psrl_embed_scale = float(torch.tensor(hidden_size**0.5).to(emb.weight.dtype))
    emb.register_forward_hook(_scale_hook)
