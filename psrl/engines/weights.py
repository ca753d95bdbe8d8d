"""Packing named tensors for a trip across a process boundary."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def pack_safetensors(named_tensors: Iterable[tuple[str, Any]]) -> tuple[bytes, int]:
    """Serialize ``(hf_name, tensor)`` pairs into one safetensors blob; returns (blob, count).

    Tensors are detached, moved to CPU and made contiguous. Tensors that share storage (tied
    embeddings sent under two names) are copied, since safetensors refuses shared storage.
    """
    import torch
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()
    for name, tensor in named_tensors:
        if not isinstance(name, str) or not name:
            raise ValueError(f"weight names must be non-empty strings, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, expected a torch.Tensor")
        if name in tensors:
            raise ValueError(f"weight {name!r} is given twice")
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen_storage:
            t = t.clone()
        else:
            seen_storage.add(ptr)
        tensors[name] = t
    if not tensors:
        raise ValueError("a weight update needs at least one tensor")
    return save(tensors), len(tensors)


def blob_shapes(blob: bytes) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from a safetensors blob's header, without loading the data."""
    if len(blob) < 8:
        raise ValueError("not a safetensors blob: shorter than its header length field")
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of the safetensors checkpoint in ``model_path`` (empty if none)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def check_update(update: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> None:
    """Raise ``ValueError`` naming every tensor of a weight update the served model cannot take.

    vLLM's in-place reload is not transactional: a bad tensor found halfway through leaves the
    model broken, so the whole update is checked before anything is loaded. A full update (every
    checkpoint tensor) is required for the same reason. ``lm_head.weight`` may be sent for a
    model with tied embeddings whose checkpoint omits it.
    """
    if not expected:
        return
    problems = []
    for name, shape in update.items():
        want = expected.get(name)
        if want is None and name == "lm_head.weight":
            want = expected.get("model.embed_tokens.weight")
        if want is None:
            problems.append(f"{name!r} is not a parameter of the served model")
        elif tuple(shape) != tuple(want):
            problems.append(f"{name!r} has shape {tuple(shape)}, the model's is {tuple(want)}")
    missing = sorted(set(expected) - set(update))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        problems.append(f"missing {len(missing)} of the model's tensors ({', '.join(missing[:5])}{more})")
    if problems:
        raise ValueError("weight update refused: " + "; ".join(problems))
