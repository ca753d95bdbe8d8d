"""Model families as data: one table per family of how Megatron's parameters and the Hugging Face
checkpoint's tensors correspond.

Each rule names a parameter inside a Megatron decoder layer (``decoder.layers.N.<megatron>``)
and the HF tensors inside ``model.layers.N.`` it is made of, how they combine (``kind``) and how
tensor parallelism splits the Megatron parameter (``split``: 0 column-parallel rows, 1
row-parallel columns, None replicated). ``{e}`` stands for an expert's index: local to the
expert-parallel rank on the Megatron side, global on the HF side.

The kinds:
- ``copy``: one HF tensor, the same values;
- ``qkv``: Megatron's fused projection, laid out per query group ``[q heads of group g, k_g, v_g]``
  from HF's q, k, v (whole query groups per tensor-parallel rank);
- ``gate_up``: the gated MLP's input ``[gate; up]`` from HF's gate and up; each tensor-parallel
  rank holds ``[gate_r; up_r]``.

The embedding, the output layer and the final norm are the same in every family and handled in
``weights.py``. Megatron-Bridge and mbridge, the maintained bridges, do not run beside this
megatron-core on a CPU without Transformer Engine (README, "Models"), so the tables live here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from .model import HFArch


@dataclass(frozen=True)
class TensorRule:
    megatron: str
    hf: tuple[str, ...]
    kind: Literal["copy", "qkv", "gate_up"] = "copy"
    split: int | None = None


def _qkv(kind: str) -> TensorRule:
    return TensorRule(f"self_attention.linear_qkv.{kind}", tuple(f"self_attn.{p}_proj.{kind}" for p in "qkv"), "qkv", 0)


ATTENTION = (
    TensorRule("input_layernorm.weight", ("input_layernorm.weight",)),
    _qkv("weight"),
    TensorRule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), split=1),
)
QKV_BIAS = (_qkv("bias"),)
QK_NORM = (
    TensorRule("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",)),
    TensorRule("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",)),
)
DENSE_MLP = (
    TensorRule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",)),
    TensorRule("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up", 0),
    TensorRule("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), split=1),
)
# Experts are not split by tensor parallelism (expert tensor parallel 1): expert parallelism
# places whole experts on ranks instead.
MOE_MLP = (
    TensorRule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",)),
    TensorRule("mlp.router.weight", ("mlp.gate.weight",)),
    TensorRule("mlp.experts.local_experts.{e}.linear_fc1.weight",
               ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"), "gate_up"),
    TensorRule("mlp.experts.local_experts.{e}.linear_fc2.weight", ("mlp.experts.{e}.down_proj.weight",)),
)
# Transformer Engine's fused specs keep the norms inside the next linear layer.
TE_FUSED_NORMS = (
    TensorRule("self_attention.linear_qkv.layer_norm_weight", ("input_layernorm.weight",)),
    TensorRule("mlp.linear_fc1.layer_norm_weight", ("post_attention_layernorm.weight",)),
)
# Gemma 3's sandwich norms: after attention and after the MLP, each before the residual add
# (the parameters of ``gemma3.Gemma3TransformerLayer``; all of Gemma's norms store w of x^ (1 + w)).
GEMMA3_NORMS = (
    TensorRule("post_attention_layernorm.weight", ("post_attention_layernorm.weight",)),
    TensorRule("pre_mlp_layernorm.weight", ("pre_feedforward_layernorm.weight",)),
    TensorRule("post_mlp_layernorm.weight", ("post_feedforward_layernorm.weight",)),
)


def layer_rules(arch: HFArch) -> dict[str, TensorRule]:
    """The family's rules by Megatron suffix (an expert rule under its ``{e}`` pattern)."""
    # Gemma 3 is built from local layers only (gemma3.py): no fused norms, whose names would clash.
    rules = list(ATTENTION) + ([] if arch.family == "gemma3" else list(TE_FUSED_NORMS))
    if arch.qkv_bias:
        rules += QKV_BIAS
    if arch.qk_norm:
        rules += QK_NORM
    if arch.family == "gemma3":
        rules += [r for r in DENSE_MLP if r.megatron != "pre_mlp_layernorm.weight"] + list(GEMMA3_NORMS)
    elif arch.num_experts:
        rules += MOE_MLP
    else:
        rules += DENSE_MLP
    return {r.megatron: r for r in rules}


_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def match_rule(rules: dict[str, TensorRule], suffix: str) -> tuple[TensorRule, int | None]:
    """(the rule, the local expert index or None) for a Megatron suffix inside a layer."""
    m = _EXPERT.match(suffix)
    key, expert = (f"mlp.experts.local_experts.{{e}}.{m.group(2)}", int(m.group(1))) if m else (suffix, None)
    rule = rules.get(key)
    if rule is None:
        raise ValueError(f"no Hugging Face counterpart for Megatron parameter {suffix!r}")
    return rule, expert


def hf_names(rule: TensorRule, layer: int, expert: int | None) -> list[str]:
    """The HF tensor names of ``rule`` in layer ``layer`` (global index), for global ``expert``."""
    pre = f"model.layers.{layer}."
    return [pre + (n.format(e=expert) if expert is not None else n) for n in rule.hf]


def tensors_per_layer(arch: HFArch) -> int:
    """How many HF tensors one decoder layer has (what an export must produce)."""
    n = 0
    for rule in layer_rules(arch).values():
        if rule in TE_FUSED_NORMS:
            continue
        n += len(rule.hf) * (arch.num_experts if "{e}" in rule.megatron else 1)
    return n
