"""Hugging Face <-> Megatron-Core weights for Llama/Qwen2 GPT models, with tensor-parallel shards.

Megatron lays out the fused QKV projection per query group ``[q heads of group g, k_g, v_g]`` and
the gated MLP input as ``[gate; up]`` within each tensor-parallel shard. Column-parallel weights
(QKV, fc1, embeddings, lm head) are split along rows, row-parallel ones (proj, fc2) along columns.
Each rank reads only the tensors it needs from the safetensors files. Export gathers the shards
over the tensor-parallel group and yields the layers this pipeline stage holds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from .model import HFArch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Megatron suffix (inside a layer) -> HF suffix (inside model.layers.N); the plain one-to-one ones.
_LAYER_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",  # TE fused spec
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",  # TE fused spec
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_ROW_PARALLEL = {"self_attention.linear_proj.weight", "mlp.linear_fc2.weight"}


class _SafetensorsDir:
    """Lazy access to the tensors of an HF directory, one or many shards."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        path = Path(path)
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = [p.name for p in sorted(path.glob("*.safetensors"))]
            if not files:
                raise FileNotFoundError(f"{path}: no *.safetensors files")
        self._handles = {f: safe_open(str(path / f), framework="pt") for f in files}
        self._where = {k: f for f, h in self._handles.items() for k in h.keys()}

    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"HF checkpoint has no tensor {name!r}")
        return self._handles[self._where[name]].get_tensor(name)


def _tp() -> tuple[int, int, dist.ProcessGroup | None]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1, None
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()


def _qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: HFArch) -> torch.Tensor:
    g, d = arch.num_kv_heads, arch.head_dim
    rest = q.shape[1:]
    q = q.reshape(g, (arch.num_heads // g) * d, *rest)
    k = k.reshape(g, d, *rest)
    v = v.reshape(g, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _qkv_from_megatron(w: torch.Tensor, arch: HFArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = arch.num_kv_heads, arch.head_dim
    hpg = arch.num_heads // g
    rest = w.shape[1:]
    w = w.reshape(g, (hpg + 2) * d, *rest)
    q, k, v = w.split([hpg * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _hf_layer(layer_number: int) -> str:
    return f"model.layers.{layer_number}."


def _global_layer_index(model, local_index: int) -> int:
    return model.decoder.layers[local_index].layer_number - 1  # layer_number is global and 1-based


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


@torch.no_grad()
def load_hf_weights(model, hf_dir: str | Path, arch: HFArch) -> None:
    """Copy an HF checkpoint into a (possibly TP-sharded, PP-staged) Megatron GPTModel."""
    model = _unwrap(model)
    src = _SafetensorsDir(hf_dir)
    rank, size, _ = _tp()

    def shard(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(size, dim=dim)[rank] if size > 1 else t

    def full(name: str) -> torch.Tensor:
        return src.get(name)

    loaded: set[str] = set()
    for name, param in model.named_parameters():
        value = _megatron_value(name, model, arch, full, shard, src.names())
        if value.shape != param.shape:
            raise ValueError(f"{name}: HF gives shape {tuple(value.shape)}, the model expects {tuple(param.shape)}")
        param.copy_(value.to(param.dtype))
        loaded.add(name)
    missing = [n for n, _ in model.named_parameters() if n not in loaded]
    if missing:
        raise ValueError(f"parameters not loaded from {hf_dir}: {missing}")


def _megatron_value(name, model, arch: HFArch, full: Callable, shard: Callable, hf_names: set[str]) -> torch.Tensor:
    if name == "embedding.word_embeddings.weight":
        return shard(full("model.embed_tokens.weight"), 0)
    if name == "output_layer.weight":
        # With tied embeddings and pipeline stages the last stage holds its own copy of the embedding.
        key = "lm_head.weight" if "lm_head.weight" in hf_names and not arch.tied_embeddings else "model.embed_tokens.weight"
        return shard(full(key), 0)
    if name == "decoder.final_layernorm.weight":
        return full("model.norm.weight")
    m = _LAYER.match(name)
    if m is None:
        raise ValueError(f"no HF counterpart for Megatron parameter {name!r}")
    pre = _hf_layer(_global_layer_index(model, int(m.group(1))))
    suffix = m.group(2)
    if suffix in _LAYER_SIMPLE:
        t = full(pre + _LAYER_SIMPLE[suffix])
        return shard(t, 1) if suffix in _ROW_PARALLEL else t
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        q, k, v = (full(f"{pre}self_attn.{p}_proj.{kind}") for p in "qkv")
        return shard(_qkv_to_megatron(q, k, v, arch), 0)  # whole query groups per rank
    if suffix == "mlp.linear_fc1.weight":
        gate, up = full(pre + "mlp.gate_proj.weight"), full(pre + "mlp.up_proj.weight")
        return torch.cat([shard(gate, 0), shard(up, 0)], dim=0)
    raise ValueError(f"no HF counterpart for Megatron parameter {name!r}")


def _gather(t: torch.Tensor, dim: int, size: int, group) -> torch.Tensor:
    if size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


@torch.no_grad()
def iter_hf_weights(model, arch: HFArch, dtype: torch.dtype | None = None,
                    into: Mapping[str, torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors of the layers on this pipeline stage.

    Every tensor-parallel rank must iterate (the shards are all-gathered); all of them get the
    full tensors. With tied embeddings ``lm_head.weight`` is not yielded, as HF checkpoints omit it.
    ``into``: tensors to write into by name (cast to their dtype on the way, e.g. a weight
    sender's shared-memory export buffers); those are yielded instead of new tensors.
    """
    model = _unwrap(model)
    _, size, group = _tp()

    def out(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
        dst = into.get(name) if into is not None else None
        if dst is None:
            return name, t.to(dtype or t.dtype, memory_format=torch.contiguous_format)  # one copy at most
        if dst.shape != t.shape:
            raise ValueError(f"cannot export {name!r} of shape {tuple(t.shape)} into a buffer of shape {tuple(dst.shape)}")
        return name, dst.copy_(t)

    for name, param in model.named_parameters():
        t = param.detach()
        if name == "embedding.word_embeddings.weight":
            yield out("model.embed_tokens.weight", _gather(t, 0, size, group))
            continue
        if name == "output_layer.weight":
            if not arch.tied_embeddings:
                yield out("lm_head.weight", _gather(t, 0, size, group))
            continue
        if name == "decoder.final_layernorm.weight":
            yield out("model.norm.weight", t)
            continue
        m = _LAYER.match(name)
        if m is None:
            raise ValueError(f"no HF counterpart for Megatron parameter {name!r}")
        pre = _hf_layer(_global_layer_index(model, int(m.group(1))))
        suffix = m.group(2)
        if suffix in _LAYER_SIMPLE:
            yield out(pre + _LAYER_SIMPLE[suffix], _gather(t, 1, size, group) if suffix in _ROW_PARALLEL else t)
        elif suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = suffix.rsplit(".", 1)[1]
            q, k, v = _qkv_from_megatron(_gather(t, 0, size, group), arch)
            for p, w in zip("qkv", (q, k, v)):
                yield out(f"{pre}self_attn.{p}_proj.{kind}", w)
        elif suffix == "mlp.linear_fc1.weight":
            parts = [torch.empty_like(t) for _ in range(size)] if size > 1 else [t]
            if size > 1:
                dist.all_gather(parts, t.contiguous(), group=group)
            gates, ups = zip(*(p.chunk(2, dim=0) for p in parts))
            # One rank's halves are views of the parameter: cast straight from them into buffers;
            # a plain export keeps getting tensors of its own (not two views of one storage).
            whole = size > 1 or into is None
            yield out(pre + "mlp.gate_proj.weight", torch.cat(gates, 0) if whole else gates[0])
            yield out(pre + "mlp.up_proj.weight", torch.cat(ups, 0) if whole else ups[0])
        else:
            raise ValueError(f"no HF counterpart for Megatron parameter {name!r}")


def hf_state_dict(model, arch: HFArch, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The whole model under HF names, gathered over pipeline stages (every rank gets it all)."""
    from megatron.core import parallel_state as ps

    local = dict(iter_hf_weights(model, arch, dtype))
    if not ps.model_parallel_is_initialized() or ps.get_pipeline_model_parallel_world_size() == 1:
        return local
    parts: list[dict[str, torch.Tensor] | None] = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(parts, local, group=ps.get_pipeline_model_parallel_group())
    merged: dict[str, torch.Tensor] = {}
    for p in parts:
        merged.update(p or {})
    return merged


def save_hf_checkpoint(model, arch: HFArch, src_dir: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write an HF directory (config/tokenizer files copied from ``src_dir``) with this model's weights."""
    import shutil

    from safetensors.torch import save_file

    state = hf_state_dict(model, arch, dtype)
    out = Path(out_dir)
    if dist.is_initialized() and dist.get_rank() != 0:
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(src_dir).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
