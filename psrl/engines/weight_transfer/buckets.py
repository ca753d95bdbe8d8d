"""Buckets: named tensors split into groups of bounded size, laid out at aligned offsets.

A bucket never splits a decoder layer (``model.layers.<i>.``): vLLM's in-place reload buffers a
layer's incoming tensors until the whole layer has arrived, so a layer must live in one bucket,
whose memory is not reused before the layer is loaded. A layer (or a single tensor) larger than
the bucket size gets a bucket of its own: memory is bounded by ``max(bucket_bytes, largest layer)``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

ALIGN = 64  # every tensor starts on a cache line: dtype views of the bucket need aligned offsets

DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool,
)}
_LAYER = re.compile(r"^(.*?layers\.\d+)\.")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # bytes from the bucket's start
    nbytes: int


@dataclass(frozen=True)
class BucketPlan:
    index: int
    tensors: tuple[TensorSpec, ...]
    nbytes: int  # the bucket's extent (last tensor's end)

    def describe(self) -> str:
        """For error messages: the bucket and the tensors it holds."""
        first, last = self.tensors[0].name, self.tensors[-1].name
        what = first if first == last else f"{first} .. {last}"
        return f"bucket {self.index} ({len(self.tensors)} tensors: {what})"

    def to_wire(self) -> list:
        return [self.index, self.nbytes, [[t.name, t.dtype, list(t.shape), t.offset, t.nbytes] for t in self.tensors]]

    @classmethod
    def from_wire(cls, wire: Sequence[Any]) -> BucketPlan:
        index, nbytes, tensors = wire
        specs = []
        for name, dtype, shape, offset, n in tensors:
            if dtype not in DTYPES:
                raise TypeError(f"weight {name!r}: unknown dtype {dtype!r}")
            specs.append(TensorSpec(str(name), dtype, tuple(int(s) for s in shape), int(offset), int(n)))
        return cls(int(index), tuple(specs), int(nbytes))


def _group(name: str) -> str:
    m = _LAYER.match(name)
    return m.group(1) if m else name


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[BucketPlan]:
    """Buckets in the order given, each at most ``bucket_bytes`` unless one layer is larger."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if not named:
        raise ValueError("a weight update needs at least one tensor")
    groups: list[list[tuple[str, torch.Tensor]]] = []
    keys: dict[str, int] = {}
    seen: set[str] = set()
    for name, t in named:
        if not isinstance(name, str) or not name:
            raise ValueError(f"weight names must be non-empty strings, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(t).__name__}, expected a torch.Tensor")
        if name in seen:
            raise ValueError(f"weight {name!r} is given twice")
        if str(t.dtype).removeprefix("torch.") not in DTYPES:
            raise TypeError(f"weight {name!r}: dtype {t.dtype} cannot be sent")
        seen.add(name)
        key = _group(name)
        if key not in keys:  # a layer's tensors stay together even when given apart
            keys[key] = len(groups)
            groups.append([])
        groups[keys[key]].append((name, t))
    plans: list[BucketPlan] = []
    current: list[TensorSpec] = []
    end = 0
    for group in groups:
        size = sum(aligned(t.numel() * t.element_size()) for _, t in group)
        if current and end + size > bucket_bytes:
            plans.append(BucketPlan(len(plans), tuple(current), end))
            current, end = [], 0
        for name, t in group:
            n = t.numel() * t.element_size()
            current.append(TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), end, n))
            end += aligned(n)
    plans.append(BucketPlan(len(plans), tuple(current), end))
    return plans


def slot_bytes(plans: Sequence[BucketPlan]) -> int:
    return max(p.nbytes for p in plans)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)``, as a plain memmove on this thread where both are contiguous CPU tensors
    of one dtype and shape (numpy, GIL released); ``copy_`` (casts, devices, strides) otherwise.

    torch's ``copy_`` splits a large CPU copy over every intra-op thread, which take the core the
    other side of a weight sync works on, on a machine the engine shares; on one thread it ran at
    about half memmove's speed for one 128 MB copy here (43-72 ms against 23-41 ms), though about
    the same for ~1 MB tensors (benchmarks/README.md, weight-sync)."""
    if (dst.device.type == src.device.type == "cpu" and dst.dtype == src.dtype and dst.shape == src.shape
            and dst.is_contiguous() and src.is_contiguous()):
        if dst.numel():
            np.copyto(dst.detach().reshape(-1).view(torch.uint8).numpy(), src.detach().reshape(-1).view(torch.uint8).numpy())
        return dst
    return dst.copy_(src, non_blocking=True)


def pack_into(buf_U8: torch.Tensor, plan: BucketPlan, tensors: Sequence[torch.Tensor]) -> None:
    """Copy a bucket's tensors into a byte buffer at their offsets (one copy, any device; CPU to
    CPU in one dtype is a memmove on this thread: ``copy_into``). On 2 cores, SmolLM2 in 16 MB
    buckets, a bucket started every 3.2 ms with torch's copy and every 2.2 ms with the memmove."""
    for spec, t in zip(plan.tensors, tensors, strict=True):
        if spec.nbytes:
            copy_into(view_of(buf_U8, spec), t)


def view_of(buf_U8: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    return buf_U8[spec.offset : spec.offset + spec.nbytes].view(DTYPES[spec.dtype]).view(spec.shape)


def views(buf_U8: torch.Tensor, plan: BucketPlan) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors over ``buf_U8`` without copying."""
    if buf_U8.numel() < plan.nbytes:
        raise ValueError(f"{plan.describe()}: buffer of {buf_U8.numel()} bytes, the bucket needs {plan.nbytes}")
    out = []
    for spec in plan.tensors:
        if spec.nbytes:
            out.append((spec.name, view_of(buf_U8, spec)))
        else:
            out.append((spec.name, torch.empty(spec.shape, dtype=DTYPES[spec.dtype], device=buf_U8.device)))
    return out
