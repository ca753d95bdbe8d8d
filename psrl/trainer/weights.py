"""Hugging Face <-> Megatron-Core weights, with tensor-parallel shards and expert-parallel experts.

What each Megatron parameter is made of is the family's table (``families.py``): the fused QKV
projection per query group, the gated MLP input as ``[gate; up]`` within each tensor-parallel
shard, experts by global index. Column-parallel weights (QKV, fc1, embeddings, lm head) are split
along rows, row-parallel ones (proj, fc2) along columns. Each rank reads only the tensors it needs
from the safetensors files. Export gathers the shards over the tensor-parallel group (and the
experts over the expert-parallel group) and yields the layers this pipeline stage holds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from .families import TensorRule, hf_names, layer_rules, match_rule
from .lora import is_lora_param
from .model import HFArch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

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


def _ep() -> tuple[int, int, dist.ProcessGroup | None]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1, None
    return (ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size(),
            ps.get_expert_model_parallel_group())


def _global_expert(arch: HFArch, local: int | None, ep_rank: int, ep_size: int) -> int | None:
    return None if local is None else ep_rank * (arch.num_experts // ep_size) + local


def join_hf(rule: TensorRule, parts: list[torch.Tensor], arch: HFArch, shard: Callable[[torch.Tensor, int], torch.Tensor]
            ) -> torch.Tensor:
    """The Megatron parameter (this rank's shard, by ``shard(tensor, dim)``) from the HF tensors of ``rule``."""
    if rule.kind == "qkv":
        return shard(_qkv_to_megatron(*parts, arch), 0)  # whole query groups per rank
    if rule.kind == "gate_up":
        if rule.split is None:
            return torch.cat(parts, dim=0)
        return torch.cat([shard(p, 0) for p in parts], dim=0)
    (t,) = parts
    return t if rule.split is None else shard(t, rule.split)


def split_hf(rule: TensorRule, t: torch.Tensor, arch: HFArch) -> list[torch.Tensor]:
    """The HF tensors of ``rule`` from its whole (tensor-parallel merged) Megatron parameter."""
    if rule.kind == "qkv":
        return list(_qkv_from_megatron(t, arch))
    if rule.kind == "gate_up":
        return list(t.chunk(2, dim=0))
    return [t]


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
        if is_lora_param(name):  # adapters (lora.py) start from their own init
            loaded.add(name)
            continue
        value = _megatron_value(name, model, arch, full, shard, src.names())
        if value.shape != param.shape:
            raise ValueError(f"{name}: HF gives shape {tuple(value.shape)}, the model expects {tuple(param.shape)}")
        param.copy_(value.to(param.dtype))
        loaded.add(name)
    missing = [n for n, _ in model.named_parameters() if n not in loaded]
    if missing:
        raise ValueError(f"parameters not loaded from {hf_dir}: {missing}")


def _megatron_value(name, model, arch: HFArch, full: Callable, shard: Callable, hf_names_: set[str]) -> torch.Tensor:
    if name == "embedding.word_embeddings.weight":
        return shard(full("model.embed_tokens.weight"), 0)
    if name == "output_layer.weight":
        # With tied embeddings and pipeline stages the last stage holds its own copy of the embedding.
        key = "lm_head.weight" if "lm_head.weight" in hf_names_ and not arch.tied_embeddings else "model.embed_tokens.weight"
        return shard(full(key), 0)
    if name == "decoder.final_layernorm.weight":
        return full("model.norm.weight")
    m = _LAYER.match(name)
    if m is None:
        raise ValueError(f"no HF counterpart for Megatron parameter {name!r}")
    rule, local = match_rule(layer_rules(arch), m.group(2))
    ep_rank, ep_size, _ = _ep()
    names = hf_names(rule, _global_layer_index(model, int(m.group(1))), _global_expert(arch, local, ep_rank, ep_size))
    return join_hf(rule, [full(n) for n in names], arch, shard)


def _gather_list(t: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    if size == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _gather(t: torch.Tensor, dim: int, size: int, group) -> torch.Tensor:
    return t if size == 1 else torch.cat(_gather_list(t, size, group), dim=dim)


def export_tensor(name: str, t: torch.Tensor, dtype: torch.dtype | None,
                  into: Mapping[str, torch.Tensor] | None) -> tuple[str, torch.Tensor]:
    """``(name, t)`` as exported: cast to ``dtype`` (one copy at most), or copied into the buffer
    ``into[name]`` when there is one."""
    dst = into.get(name) if into is not None else None
    if dst is None:
        return name, t.to(dtype or t.dtype, memory_format=torch.contiguous_format)
    if dst.shape != t.shape:
        raise ValueError(f"cannot export {name!r} of shape {tuple(t.shape)} into a buffer of shape {tuple(dst.shape)}")
    return name, dst.copy_(t)


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
        return export_tensor(name, t, dtype, into)

    rules = layer_rules(arch)
    ep_rank, ep_size, ep_group = _ep()
    # Low-rank adapters (``lora.py``) are merged into the weights they adapt.
    adapted = {f"{path}.weight": m.lora for path, m in model.named_modules() if hasattr(m, "lora")}
    for name, param in model.named_parameters():
        if is_lora_param(name):
            continue
        t = param.detach()
        if name in adapted:
            t = (t.float() + adapted[name].delta_weight()).to(t.dtype)
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
        layer = _global_layer_index(model, int(m.group(1)))
        rule, local = match_rule(rules, m.group(2))
        if local is not None:  # every expert-parallel rank's copy of this local expert, in rank order
            for r, part in enumerate(_gather_list(t, ep_size, ep_group)):
                for n, w in zip(hf_names(rule, layer, _global_expert(arch, local, r, ep_size)), split_hf(rule, part, arch)):
                    yield out(n, w if into is not None or len(rule.hf) == 1 else w.clone())  # no two views of one storage
            continue
        names = hf_names(rule, layer, None)
        if rule.kind == "gate_up" and rule.split == 0:
            parts = _gather_list(t, size, group)
            gates, ups = zip(*(p.chunk(2, dim=0) for p in parts))
            # One rank's halves are views of the parameter: cast straight from them into buffers;
            # a plain export keeps getting tensors of its own (not two views of one storage).
            whole = size > 1 or into is None
            yield out(names[0], torch.cat(gates, 0) if whole else gates[0])
            yield out(names[1], torch.cat(ups, 0) if whole else ups[0])
            continue
        merged = t if rule.split is None else _gather(t, rule.split, size, group)
        for n, w in zip(names, split_hf(rule, merged, arch), strict=True):
            yield out(n, w)


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
