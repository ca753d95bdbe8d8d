"""A Megatron-Core GPTModel built from a Hugging Face config (Llama 2/3, Mistral, Qwen2, Qwen3 dense
and MoE, Gemma 3 text). The per-family weight tables are in ``families.py``."""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# HF model_type -> family
SUPPORTED_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "mistral": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
                      "gemma3_text": "gemma3"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class HFArch:
    """The architecture facts of an HF checkpoint that the Megatron model must reproduce."""

    family: str  # a value of SUPPORTED_FAMILIES
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    rope_llama3_factor: float | None  # llama-3.x rope scaling, None when absent
    tied_embeddings: bool
    qkv_bias: bool
    max_positions: int
    torch_dtype: str  # dtype of the stored weights
    qk_norm: bool = False  # an RMSNorm over each head's queries and keys (Qwen3, Gemma 3)
    # Mixture of experts (0: a dense MLP): experts per layer, experts per token, each expert's
    # hidden size, whether the top-k probabilities are renormalized to sum to 1, HF's aux-loss coefficient.
    num_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0
    # Gemma 3: per layer "sliding_attention" or "full_attention", the window, the sliding layers'
    # rope base, the attention scale's 1/sqrt(query_pre_attn_scalar), and embeddings times sqrt(hidden).
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    activation: str = "silu"  # "silu" | "gelu_tanh"

    @classmethod
    def from_pretrained(cls, path: str | Path) -> HFArch:
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{path}: no config.json (not a Hugging Face model directory)")
        c = json.loads(cfg_file.read_text())
        model_type = c.get("model_type", "")
        if model_type not in SUPPORTED_FAMILIES:
            raise ValueError(
                f"{path}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        family = SUPPORTED_FAMILIES[model_type]
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        local_rope = None
        if family == "gemma3" and "full_attention" in rope:  # one rope per layer type
            rope, local_rope = rope["full_attention"], rope.get("sliding_attention") or {}
        theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        llama3 = None
        if rope_type == "llama3":
            expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
            if any(float(rope.get(k, v)) != v for k, v in expected.items()):
                raise ValueError(f"{path}: llama3 rope scaling with {rope} is not supported (Megatron fixes {expected})")
            llama3 = float(rope["factor"])
        elif rope_type != "default":
            raise ValueError(f"{path}: rope_type {rope_type!r} is not supported (default, llama3)")
        if c.get("mlp_bias"):
            raise ValueError(f"{path}: mlp_bias=True is not supported")
        act = c.get("hidden_activation") or c.get("hidden_act") or "silu"
        activations = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
        if act not in activations or (family == "gemma3") != (act == "gelu_pytorch_tanh"):
            raise ValueError(f"{path}: hidden activation {act!r} is not supported for {model_type}")
        heads = int(c["num_attention_heads"])
        moe = {}
        if family == "qwen3_moe":
            if int(c.get("decoder_sparse_step", 1)) != 1 or c.get("mlp_only_layers"):
                raise ValueError(f"{path}: dense layers between MoE layers (decoder_sparse_step, mlp_only_layers) are not supported")
            moe = dict(
                num_experts=int(c.get("num_experts") or c["num_local_experts"]), moe_top_k=int(c["num_experts_per_tok"]),
                moe_ffn_hidden_size=int(c["moe_intermediate_size"]), moe_norm_topk_prob=bool(c.get("norm_topk_prob", False)),
                router_aux_loss_coef=float(c.get("router_aux_loss_coef") or 0.0),
            )
        gemma = {}
        if family == "gemma3":
            if c.get("attn_logit_softcapping") or c.get("final_logit_softcapping"):
                raise ValueError(f"{path}: logit soft-capping is not supported")
            n = int(c["num_hidden_layers"])
            types = c.get("layer_types") or [
                "full_attention" if (i + 1) % int(c.get("sliding_window_pattern", 6)) == 0 else "sliding_attention"
                for i in range(n)]
            gemma = dict(
                layer_types=tuple(types), sliding_window=int(c["sliding_window"]),
                rope_local_theta=float((local_rope or {}).get("rope_theta", c.get("rope_local_base_freq", 10000.0))),
                query_pre_attn_scalar=float(c.get("query_pre_attn_scalar") or c.get("head_dim") or 256),
            )
        return cls(
            family=family,
            vocab_size=int(c["vocab_size"]),
            hidden_size=int(c["hidden_size"]),
            ffn_hidden_size=int(c["intermediate_size"]),
            num_layers=int(c["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
            rms_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_llama3_factor=llama3,
            tied_embeddings=bool(c.get("tie_word_embeddings", family == "gemma3")),
            # Qwen2 always has q/k/v biases; Llama only with attention_bias (then o_proj has one too).
            qkv_bias=family == "qwen2" or bool(c.get("attention_bias", False)),
            max_positions=int(c.get("max_position_embeddings", 4096)),
            torch_dtype=str(c.get("torch_dtype") or c.get("dtype") or "float32"),
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
            activation=activations[act],
            **moe, **gemma,
        )

    def check_parallel(self, tp: int, pp: int) -> None:
        problems = []
        if self.num_kv_heads % tp:
            problems.append(f"{self.num_kv_heads} key/value heads are not divisible by tensor parallel {tp}")
        if self.vocab_size % tp:
            problems.append(f"vocab size {self.vocab_size} is not divisible by tensor parallel {tp}")
        if self.ffn_hidden_size % tp:
            problems.append(f"intermediate size {self.ffn_hidden_size} is not divisible by tensor parallel {tp}")
        if self.num_layers % pp:
            problems.append(f"{self.num_layers} layers are not divisible by pipeline parallel {pp}")
        if self.family != "qwen2" and self.qkv_bias:
            problems.append(f"{self.family} attention_bias=True (an o_proj bias) is not supported")
        if problems:
            raise ValueError("cannot shard this model: " + "; ".join(problems))


# trainer.recompute -> Megatron's activation-recompute settings. "full" keeps only each layer's
# input and recomputes the layer in backward (memory per layer: one (T, hidden) tensor);
# "selective" recomputes the MLP, whose activations (2 x ffn per token) are the largest per token
# (Megatron's selective "layernorm" recompute needs Transformer Engine).
_RECOMPUTE = {
    "none": {},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["mlp"]},
}


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def moe_options(arch: HFArch, *, ep: int = 1, aux_loss_coef: float | None = None) -> dict:
    """Megatron's MoE settings for ``arch`` (empty for a dense model). HF's router: softmax over
    the experts, the top k, renormalized when ``norm_topk_prob``; Megatron's default order (top k
    of the logits, then a softmax over those k) gives the renormalized probabilities, and softmax
    first gives the others. Every expert takes every token routed to it (no capacity, no drops).
    ``aux_loss_coef`` None: the checkpoint's own coefficient. Router replay is ours
    (``moe.install_replay``): Megatron's keeps its instances in a process-wide list."""
    if not arch.num_experts:
        if ep != 1:
            raise ValueError(f"trainer.parallel.expert={ep} needs a mixture-of-experts model; this {arch.family} model is dense")
        return {}
    if arch.num_experts % ep:
        raise ValueError(f"{arch.num_experts} experts do not divide over expert parallel {ep}")
    coef = arch.router_aux_loss_coef if aux_loss_coef is None else aux_loss_coef
    return dict(
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.moe_top_k,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_pre_softmax=not arch.moe_norm_topk_prob,
        moe_router_load_balancing_type="aux_loss" if coef > 0 else "none",
        moe_aux_loss_coeff=coef,
        moe_grouped_gemm=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
    )


def _gemma3_options(arch: HFArch) -> dict:
    # Attention scores scaled by 1/sqrt(query_pre_attn_scalar), not 1/sqrt(head_dim).
    return {"softmax_scale": arch.query_pre_attn_scalar**-0.5}


def transformer_config(arch: HFArch, *, tp: int, pp: int, dtype: str, device: str, recompute: str = "none",
                       ep: int = 1, aux_loss_coef: float | None = None):
    """Megatron's TransformerConfig for ``arch``: local (non-fused) kernels, no dropout."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch.check_parallel(tp, pp)
    if recompute not in _RECOMPUTE:
        raise ValueError(f"unknown trainer.recompute {recompute!r} ({', '.join(_RECOMPUTE)})")
    params_dtype = _DTYPES[dtype]
    return TransformerConfig(
        **_RECOMPUTE[recompute],
        **moe_options(arch, ep=ep, aux_loss_coef=aux_loss_coef),
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_eps,
        gated_linear_unit=True,
        activation_func=F.silu if arch.activation == "silu" else _gelu_tanh,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        attention_softmax_in_fp32=True,
        variable_seq_lengths=True,  # packed micro-batches differ in length
        moe_token_dispatcher_type="alltoall",  # "allgather" refuses variable lengths
        use_cpu_initialization=device == "cpu",
        # Every weight is then overwritten from the HF checkpoint, but skipping initialization also
        # skips tagging weights as tensor-parallel (grad-norm accounting relies on the tag).
        perform_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
        # q/k norms: finalize_model_grads sums their gradients over tensor-parallel ranks (each
        # rank's heads give a part of them; without it the replicas drift apart from the first step).
        qk_layernorm=arch.qk_norm,
        **(_gemma3_options(arch) if arch.family == "gemma3" else {}),
    )


def layer_spec(arch: HFArch, rope=None, *, layer_type: str = "full_attention"):
    """Megatron's local layer spec for ``arch`` (q/k norms, experts) with
    :class:`~psrl.trainer.attention.DocumentAttention` as core attention: no (T, T) mask or score
    matrix, documents of a packed micro-batch kept apart, and RoPE applied from ``rope`` (a
    :class:`~psrl.trainer.attention.RotaryTable`) when given. Gemma 3: the layer of
    ``layer_type`` ("sliding_attention" attends within ``arch.sliding_window``), see ``gemma3.py``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    from .attention import DocumentAttention

    spec = get_gpt_layer_local_spec(
        normalization="RMSNorm", qk_layernorm=arch.qk_norm, num_experts=arch.num_experts or None, moe_grouped_gemm=False,
    )
    params = {"rope": rope}
    if arch.family == "gemma3":
        params["window"] = arch.sliding_window if layer_type == "sliding_attention" else None
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(module=DocumentAttention, params=params)
    if arch.family == "gemma3":
        from .gemma3 import gemma3_layer_spec

        return gemma3_layer_spec(spec)
    return spec


def rotary_table(arch: HFArch, theta: float | None = None):
    """The model's RoPE frequencies (Megatron's, llama3 scaling included) as a shared table;
    ``theta``: another base than ``arch.rope_theta`` (Gemma 3's sliding layers)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from .attention import RotaryTable

    theta = arch.rope_theta if theta is None else theta
    rope = RotaryEmbedding(
        kv_channels=arch.head_dim, rotary_percent=1.0,
        rotary_base=int(theta) if float(theta).is_integer() else theta,
        rope_scaling=arch.rope_llama3_factor is not None, rope_scaling_factor=arch.rope_llama3_factor or 8.0,
        use_cpu_initialization=True,
    )
    return RotaryTable(rope.inv_freq)


def _native_linear(input, weight, bias=None, **_unused):
    return F.linear(input, weight, bias)


def use_native_linears(model) -> int:
    """Without tensor parallelism Megatron's linear layers compute what ``F.linear`` computes, but
    through a Python autograd function (and an identity "copy to the TP region" function before
    each column-parallel layer, a "reduce from the TP region" one after each row-parallel layer),
    whose backward runs in Python per layer. Swap in the native op:
    the gradients are the same and still reach the DDP buffer through the parameters' hooks.
    Returns how many layers were switched. Only valid at tensor parallel 1 (the caller checks)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    n = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and not module.config.gradient_accumulation_fusion:
            module._forward_impl = _native_linear
            if isinstance(module, ColumnParallelLinear):
                module.disable_grad_reduce = True  # skips the identity copy-to-TP-region function
            elif module.skip_bias_add and not module.sequence_parallel:
                # Skips the identity reduce-from-TP-region function after it: at TP 1 this flag
                # (meant for experts, which reduce elsewhere) changes nothing else in its forward.
                module.explicit_expert_comm = True
            n += 1
    return n


def _scored_rows_hook(layer, args, kwargs):
    """Forward pre-hook of the output layer: hidden (s, b, h) -> (K, 1, h), the rows of
    ``layer.psrl_rows`` (flat positions over (b, s), row-major), when set."""
    rows = layer.psrl_rows
    if rows is None:
        return None
    hidden = args[0]
    hidden = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1]).index_select(0, rows.to(hidden.device))
    return (hidden.unsqueeze(1), *args[1:]), kwargs


@contextmanager
def scoring_rows(model, rows):
    """Within it, ``model``'s output layer (a model from :func:`build_gpt_model`, possibly wrapped
    in DDP) scores only the flat positions ``rows`` (a ``MicroBatch.scored``): the model returns
    (1, K, V) logits instead of (B, T, V). The hidden states of the other positions still pass
    through every layer (attention needs them); only the vocabulary projection and everything
    after it shrink, to the tokens the loss reads. A model without the hook (a pipeline stage
    without the output layer, the critic's value head) is left as it is."""
    while hasattr(model, "module"):
        model = model.module
    layer = getattr(model, "output_layer", None) if getattr(model, "post_process", False) else None
    if layer is None or not hasattr(layer, "psrl_rows"):
        yield
        return
    layer.psrl_rows = rows
    try:
        yield
    finally:
        layer.psrl_rows = None


def _moe_without_transformer_engine() -> None:
    """Megatron-Core 0.16's router gating reads ``te_general_gemm``, which its module defines only
    when Transformer Engine imports (NameError otherwise); None selects its plain-torch branch."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_gpt_model(arch: HFArch, config, *, pre_process: bool, post_process: bool, tie_embeddings: bool | None = None):
    """``tie_embeddings`` None: as the checkpoint says (False gives the output layer its own weight).
    The output layer can be limited to the scored positions (:func:`scoring_rows`)."""
    from megatron.core.models.gpt import GPTModel

    from .norm import use_fused_rms_norms

    if arch.num_experts:
        _moe_without_transformer_engine()
    if arch.family == "gemma3":  # per layer type: its window and its rope base, one table each
        from .gemma3 import decoder_block_spec

        bases = {"sliding_attention": arch.rope_local_theta, "full_attention": arch.rope_theta}
        spec = decoder_block_spec(arch, config, {
            t: layer_spec(arch, rotary_table(arch, theta), layer_type=t) for t, theta in bases.items()})
    else:
        spec = layer_spec(arch, rotary_table(arch))
    model = GPTModel(
        config=config,
        # RoPE is applied inside the core attention, from one table per model (see attention.py).
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_positions,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,  # log-probs are computed on vocab-parallel logits
        share_embeddings_and_output_weights=arch.tied_embeddings if tie_embeddings is None else tie_embeddings,
        position_embedding_type="none",
    )
    if arch.family == "gemma3" and pre_process:
        from .gemma3 import scale_embeddings

        scale_embeddings(model, arch.hidden_size)
    if config.tensor_model_parallel_size == 1:
        use_native_linears(model)
    use_fused_rms_norms(model)
    if post_process and not config.sequence_parallel:  # sequence parallel: the rows are spread over ranks
        model.output_layer.psrl_rows = None
        model.output_layer.register_forward_pre_hook(_scored_rows_hook, with_kwargs=True)
    return model
