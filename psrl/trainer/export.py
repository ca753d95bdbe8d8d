"""Megatron checkpoints -> Hugging Face directories, on one CPU process, without Megatron running.

A trainer checkpoint is one ``tp<T>_pp<P>.pt`` per tensor/pipeline rank (``checkpoint.py``).
:func:`merge_shards` puts the shards of one step back into a single Megatron state dict
(tensor-parallel pieces concatenated along the dimension each was split on, pipeline stages'
layer numbers made global), :func:`megatron_to_hf` renames and splits that into Hugging Face
tensors (the inverse of ``weights.load_hf_weights``), and :func:`export_checkpoint` writes a
directory that ``transformers`` and vLLM load: ``model.safetensors``, ``config.json``, the
tokenizer files with their chat template, and ``generation_config.json``.

This is the one Megatron -> HF conversion of saved checkpoints; ``psrl export``, ``psrl train``
(``trainer.export_hf=true``) and evaluation of a checkpoint all go through it.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .families import hf_names, layer_rules, match_rule, tensors_per_layer
from .lora import is_lora_param, merge_into, peft_tensors
from .lora import merge_tp as lora_merge_tp
from .model import HFArch
from .weights import _LAYER, split_hf

_SHARD = re.compile(r"^tp(\d+)_pp(\d+)\.pt$")
# Files of the source model directory that are not carried over: the weights (re-written) and
# formats we do not write.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
_WEIGHT_FILES = {"model.safetensors.index.json", "pytorch_model.bin.index.json"}
EXPORT_INFO = "psrl_export.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(ValueError):
    """The checkpoint cannot be exported (named, with the reason)."""


def find_trainer_step(path: str | Path) -> Path:
    """The trainer step directory (holding ``tp*_pp*.pt``) for any of: a pipeline checkpoint root
    (``trainer.checkpoint_dir``), a pipeline step (``step_000010``), a trainer checkpoint root
    (with ``latest``) or a trainer step directory."""
    p = Path(path)
    if not p.is_dir():
        raise ExportError(f"{p}: no such checkpoint directory")
    if any(_SHARD.match(f.name) for f in p.iterdir()):
        return p
    if (p / "pipeline.json").is_file() and (p / "trainer").is_dir():
        return find_trainer_step(p / "trainer")
    if (p / "latest").is_file():
        step = p / (p / "latest").read_text().strip()
        if not step.is_dir():
            raise ExportError(f"{p}/latest names {step.name}, which does not exist")
        return find_trainer_step(step)
    steps = sorted((d for d in p.glob("step_*") if d.is_dir() and d.name[5:].isdigit()), key=lambda d: int(d.name[5:]))
    if steps:
        return find_trainer_step(steps[-1])
    raise ExportError(f"{p}: not a checkpoint (no tp*_pp*.pt shards, pipeline.json, 'latest' or step_* directories)")


def load_shards(step_dir: Path) -> tuple[dict[tuple[int, int], dict[str, torch.Tensor]], dict[str, Any]]:
    """Each rank's model state, keyed by (tp rank, pp rank), and the step's metadata."""
    shards: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    meta: dict[str, Any] = {}
    for f in sorted(step_dir.iterdir()):
        m = _SHARD.match(f.name)
        if m is None:
            continue
        state = torch.load(f, map_location="cpu", weights_only=False, mmap=True)  # only the model part is read
        if "model" not in state or "layout" not in state:
            raise ExportError(f"{f}: not a PSRL trainer checkpoint shard")
        shards[(int(m.group(1)), int(m.group(2)))] = state["model"]
        meta = {"step": state.get("step"), "version": state.get("version"), "layout": state["layout"],
                "lora": state.get("lora")}
    if not shards:
        raise ExportError(f"{step_dir}: no tp*_pp*.pt shards")
    tp, pp = int(meta["layout"]["tp"]), int(meta["layout"]["pp"])
    missing = [f"tp{t}_pp{p}.pt" for t in range(tp) for p in range(pp) if (t, p) not in shards]
    if missing:
        raise ExportError(f"{step_dir}: the checkpoint was saved with tp={tp} pp={pp} but lacks {missing}")
    return shards, meta


def merge_shards(shards: Mapping[tuple[int, int], Mapping[str, Any]], arch: HFArch, tp: int, pp: int) -> dict[str, torch.Tensor]:
    """One Megatron state dict (tp=1, pp=1 names and shapes) from every rank's shard."""
    if arch.num_layers % pp:
        raise ExportError(f"{arch.num_layers} layers do not split over {pp} pipeline stages")
    per_stage = arch.num_layers // pp
    full: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        for name, first in shards[(0, stage)].items():
            if not isinstance(first, torch.Tensor):
                continue  # _extra_state entries of the local (non-TE) layers hold None
            parts = [shards[(t, stage)][name] for t in range(tp)]
            m = _LAYER.match(name)
            if m is not None:
                name = f"decoder.layers.{stage * per_stage + int(m.group(1))}.{m.group(2)}"
            if name in full and name != "output_layer.weight":
                raise ExportError(f"{name} appears in two pipeline stages")
            full[name] = _merge_tp(name, parts, arch)
    return full


def _merge_tp(name: str, parts: list[torch.Tensor], arch: HFArch) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0]
    if is_lora_param(name):
        return lora_merge_tp(name, parts)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return torch.cat(parts, dim=0)  # vocab-parallel rows
    m = _LAYER.match(name)
    if m is None:
        return parts[0]  # replicated (the final norm)
    rule, _ = match_rule(layer_rules(arch), m.group(2))
    if rule.kind == "gate_up" and rule.split == 0:  # each rank holds [gate_r; up_r]
        gates, ups = zip(*(p.chunk(2, dim=0) for p in parts), strict=True)
        return torch.cat([*gates, *ups], dim=0)
    return parts[0] if rule.split is None else torch.cat(parts, dim=rule.split)


def megatron_to_hf(state: Mapping[str, torch.Tensor], arch: HFArch, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Hugging Face tensors from a merged Megatron state dict (global layer numbers and experts)."""
    out: dict[str, torch.Tensor] = {}
    rules = layer_rules(arch)

    def put(name: str, t: torch.Tensor) -> None:
        out[name] = (t.to(dtype) if dtype is not None else t).contiguous().clone()

    for name, t in state.items():
        if name == "embedding.word_embeddings.weight":
            put("model.embed_tokens.weight", t)
        elif name == "output_layer.weight":
            if not arch.tied_embeddings:  # with tied embeddings the last stage's copy is the same tensor
                put("lm_head.weight", t)
        elif name == "decoder.final_layernorm.weight":
            put("model.norm.weight", t)
        elif (m := _LAYER.match(name)) is not None:
            try:
                rule, expert = match_rule(rules, m.group(2))
            except ValueError as e:
                raise ExportError(f"{e} (in {name!r})") from None
            for n, w in zip(hf_names(rule, int(m.group(1)), expert), split_hf(rule, t, arch), strict=True):
                put(n, w)
        else:
            raise ExportError(f"no Hugging Face counterpart for Megatron parameter {name!r}")
    expected = 2 + (0 if arch.tied_embeddings else 1) + arch.num_layers * tensors_per_layer(arch)
    if len(out) != expected:
        raise ExportError(f"the checkpoint gives {len(out)} tensors, a {arch.family} model of this shape has {expected}")
    return out


def export_checkpoint(
    checkpoint: str | Path, out_dir: str | Path, model_dir: str | Path, *, dtype: str = "auto", overwrite: bool = True,
    merge: bool = True,
) -> Path:
    """Write the checkpoint's policy as a Hugging Face directory ``out_dir``.

    ``model_dir`` is the HF directory the run started from (its config, tokenizer, chat template
    and generation config are carried over). ``dtype``: "auto" keeps the source model's dtype.
    The directory is written beside ``out_dir`` and renamed into place when complete.
    A checkpoint of LoRA adapters (``trainer.lora``) gives the base with the adapters merged in,
    or with ``merge=False`` a PEFT adapter directory (``adapter_config.json``,
    ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads over the base.
    """
    from safetensors.torch import save_file

    step_dir = find_trainer_step(checkpoint)
    model_dir, out = Path(model_dir), Path(out_dir)
    arch = HFArch.from_pretrained(model_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out} exists and is not empty")
    shards, meta = load_shards(step_dir)
    merged = merge_shards(shards, arch, int(meta["layout"]["tp"]), int(meta["layout"]["pp"]))
    name = arch.torch_dtype if dtype == "auto" else dtype
    if name not in _DTYPES:
        raise ExportError(f"dtype {name!r} is not one of {sorted(_DTYPES)} (or auto)")
    lora = meta.get("lora")
    info = {"checkpoint": str(step_dir.absolute()), "source_model": str(model_dir.absolute()), "dtype": name, **meta}
    if lora is not None:
        adapter = peft_tensors(merged, _DTYPES[name])
        if not merge:
            return _write_adapter(out, adapter, {**lora["adapter_config"], "base_model_name_or_path": str(model_dir)}, info)
        tensors = _base_tensors(model_dir, _DTYPES[name])
        try:
            merge_into(tensors, adapter, lora["config"]["alpha"] / lora["config"]["rank"])
        except KeyError as e:
            raise ExportError(f"{model_dir} has no weight {e} for the checkpoint's adapters (not their base model?)") from None
    else:
        tensors = megatron_to_hf(merged, arch, _DTYPES[name])

    tmp = _fresh_tmp(out)
    for f in sorted(model_dir.iterdir()):
        if f.is_file() and not f.name.startswith(".") and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in _WEIGHT_FILES:
            shutil.copy2(f, tmp / f.name)
    config = json.loads((model_dir / "config.json").read_text())
    config["torch_dtype" if "torch_dtype" in config else "dtype"] = name
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if not (tmp / "generation_config.json").is_file():
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return _finish(tmp, out, info)


def _fresh_tmp(out: Path) -> Path:
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _finish(tmp: Path, out: Path, info: dict) -> Path:
    (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def _base_tensors(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ExportError(f"{model_dir}: no *.safetensors weights to merge the adapters into")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update({k: v.to(dtype) for k, v in load_file(str(f)).items()})
    return out


def _write_adapter(out: Path, tensors: dict[str, torch.Tensor], config: dict, info: dict) -> Path:
    from safetensors.torch import save_file

    tmp = _fresh_tmp(out)
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    return _finish(tmp, out, info)
