"""The two CPU data planes: ``shm`` (one machine) and ``tcp`` (across machines).

- ``shm``: a file in /dev/shm holding ``window`` slots; the sender copies a bucket into a slot
  (the one copy on this side), the receiver maps the file read-only and loads straight from it.
- ``tcp``: the tensors' own memory goes out as ZeroMQ frames after the bucket's header (no
  copy on the sender); the receiver loads from the received frames.

``bench trainer`` (benchmarks/weight_sync.py) measures both against a safetensors file round
trip and raw loopback tcp.
"""

from __future__ import annotations

import mmap
import os
import socket
import tempfile
import uuid
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from .buckets import DTYPES, BucketPlan, pack_into, views

Named = list[tuple[str, torch.Tensor]]


def machine_id() -> str:
    """Same value in every process of one machine (and one kernel boot): who can share /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def choose_plane(source: dict[str, Any], wanted: str, available: Sequence[str]) -> str:
    """The plane a receiver uses for ``source``: ``wanted`` unless "auto"; auto is shm on the
    sender's machine, tcp elsewhere."""
    if wanted != "auto":
        if wanted not in available or wanted not in source.get("planes", [wanted]):
            raise ValueError(f"weight transfer plane {wanted!r} is not available here (have {sorted(available)})")
        return wanted
    return "shm" if source.get("machine") == machine_id() and "shm" in available else "tcp"


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _frombuffer(buf: Any, dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only memory: loaders copy out of it, never write
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.frombuffer(buf, dtype=dtype)


class ShmPlane:
    name = "shm"

    def __init__(self, window: int) -> None:
        self.window = window
        self.path: str | None = None
        self._size = 0
        self._mm: mmap.mmap | None = None
        self._buf: torch.Tensor | None = None

    def _ensure(self, slot_bytes: int) -> torch.Tensor:
        size = self.window * slot_bytes
        if self._buf is None or self._size < size:
            self.close()
            self.path = os.path.join(shm_dir(), f"psrl-weights-{uuid.uuid4().hex[:12]}")
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, size)
                self._mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            self._size = size
            self._buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        return self._buf

    def stage(self, slot: int, slot_bytes: int, plan: BucketPlan, tensors: Sequence[torch.Tensor]) -> tuple[dict[str, Any], list[Any]]:
        # The slot stride is the file's, fixed when it was made: a later, smaller plan reuses it.
        buf = self._ensure(slot_bytes)
        stride = self._size // self.window
        pack_into(buf[slot * stride : slot * stride + plan.nbytes], plan, tensors)
        return {"path": self.path, "size": self._size, "offset": slot * stride}, []

    def after_send(self, slot: int, plan: BucketPlan) -> None:
        pass

    def close(self) -> None:
        self._buf = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view is still alive somewhere: the mapping goes with it
                pass
            self._mm = None
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None


class ShmReader:
    name = "shm"

    def __init__(self) -> None:
        self._maps: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}

    def read(self, header: dict[str, Any], plan: BucketPlan, frames: Sequence[Any]) -> Named:
        path, size, offset = header["path"], int(header["size"]), int(header["offset"])
        if path not in self._maps:
            self._maps.clear()  # the sender made a bigger file; the old one is gone
            fd = os.open(path, os.O_RDONLY)
            try:
                mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
            self._maps[path] = (mm, _frombuffer(mm, torch.uint8))
        buf = self._maps[path][1]
        return views(buf[offset : offset + plan.nbytes], plan)

    def close(self) -> None:
        self._maps.clear()


def _as_bytes(t: torch.Tensor) -> Any:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()  # bf16 has no numpy dtype: bytes


class TcpPlane:
    name = "tcp"

    def stage(self, slot: int, slot_bytes: int, plan: BucketPlan, tensors: Sequence[torch.Tensor]) -> tuple[dict[str, Any], list[Any]]:
        return {}, [_as_bytes(t) for t in tensors]

    def after_send(self, slot: int, plan: BucketPlan) -> None:
        pass

    def close(self) -> None:
        pass


class TcpReader:
    name = "tcp"

    def read(self, header: dict[str, Any], plan: BucketPlan, frames: Sequence[Any]) -> Named:
        if len(frames) != len(plan.tensors):
            raise ValueError(f"{plan.describe()}: {len(frames)} data frames for {len(plan.tensors)} tensors")
        out = []
        for spec, frame in zip(plan.tensors, frames):
            buf = frame.buffer if hasattr(frame, "buffer") else frame
            if len(buf) != spec.nbytes:
                raise ValueError(f"{plan.describe()}: {spec.name!r} arrived with {len(buf)} bytes, expected {spec.nbytes}")
            dtype = DTYPES[spec.dtype]
            t = _frombuffer(buf, dtype) if spec.nbytes else torch.empty(0, dtype=dtype)
            out.append((spec.name, t.view(spec.shape)))
        return out

    def close(self) -> None:
        pass


class IpcPlane(TcpPlane):
    """``tcp``'s frames over the sender's ipc:// (unix socket) endpoint: one machine, no tcp stack."""

    name = "ipc"


class IpcReader(TcpReader):
    name = "ipc"
