"""The two CPU data planes: ``shm`` (one machine) and ``tcp`` (across machines).

- ``shm``: a file in /dev/shm holding ``window`` slots; the sender copies a bucket into a slot
  (the one copy on this side), the receiver maps the file read-only and loads straight from it.
  A version exported into the plane's export buffers (``export_buffers``: every tensor of the
  last version sent, in one shared file, in bucket order) is sent as it lies, with no copy on
  this side: the trainer's export (a dtype cast, a gather) writes straight where the engines read.
- ``tcp``: the tensors' own memory goes out as ZeroMQ frames after the bucket's header (no
  copy on the sender), each tensor a message of its own; the receiver loads each from its
  received frame as it arrives.

``bench trainer`` (benchmarks/weight_sync.py) measures both against a safetensors file round
trip and raw loopback tcp.
"""

from __future__ import annotations

import math
import mmap
import os
import socket
import tempfile
import uuid
import warnings
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any

import torch

from .base import WeightTransferError
from .buckets import ALIGN, DTYPES, BucketPlan, TensorSpec, aligned, pack_into, view_of, views

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


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class NoRoom(OSError):
    """The shared-memory file system cannot hold a file of the size asked for."""


class _ShmFile:
    """A new file in /dev/shm of ``size`` bytes, mapped read-write here. Raises ``NoRoom`` when
    /dev/shm has less free space (a container's is often 64 MB): writing past a tmpfs's end
    would kill the process with SIGBUS instead."""

    def __init__(self, size: int) -> None:
        where = shm_dir()
        free = free_bytes(where)
        if free < size:
            raise NoRoom(f"{where} has {free / 2**20:.1f} MiB free; the weight transfer needs "
                         f"{size / 2**20:.1f} MiB there (weight_sync.transport=tcp, or a larger /dev/shm)")
        self.path = os.path.join(where, f"psrl-weights-{uuid.uuid4().hex[:12]}")
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.size = size
        self.buf = torch.frombuffer(self.mm, dtype=torch.uint8)

    def close(self) -> None:
        del self.buf
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with it
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


Layout = list[tuple[str, str, tuple[int, ...]]]  # (name, dtype name, shape) in bucket order


class _ExportBuffers:
    """Every tensor of a version, in bucket order at the buckets' aligned offsets, in one file:
    any bucket of those tensors (any bucket size) is one contiguous range of it."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        specs, end = [], 0
        for name, dtype, shape in layout:
            nbytes = math.prod(shape) * DTYPES[dtype].itemsize
            specs.append(TensorSpec(name, dtype, shape, end, nbytes))
            end += aligned(nbytes)
        self.file = _ShmFile(max(end, ALIGN))
        self.named = [(s.name, view_of(self.file.buf, s)) for s in specs]

    def offset_of(self, plan: BucketPlan, tensors: Sequence[torch.Tensor]) -> int | None:
        """Where bucket ``plan`` starts in the file when ``tensors`` lie there exactly as the plan
        lays them out; None when any does not (it is then staged by copying)."""
        base, start = self.file.buf.data_ptr(), None
        for spec, t in zip(plan.tensors, tensors, strict=True):
            if not spec.nbytes:
                continue
            if t.device.type != "cpu" or not t.is_contiguous():
                return None
            at = t.data_ptr() - base
            if start is None:
                start = at - spec.offset
            if at != start + spec.offset or start < 0 or at + spec.nbytes > self.file.size:
                return None
        return start


class ShmPlane:
    name = "shm"
    streams_frames = False

    def __init__(self, window: int) -> None:
        self.window = window
        self._slots: _ShmFile | None = None
        self._exports: _ExportBuffers | None = None

    @property
    def path(self) -> str | None:
        """The slots' file (None until a bucket had to be copied into one)."""
        return self._slots.path if self._slots is not None else None

    def export_buffers(self, layout: Layout) -> list[tuple[str, torch.Tensor]] | None:
        """Tensors shaped as ``layout`` in shared memory (made anew when the layout changes);
        None when /dev/shm has no room for them (the export then makes tensors of its own)."""
        if self._exports is None or self._exports.layout != layout:
            if self._exports is not None:
                self._exports.file.close()
                self._exports = None
            try:
                self._exports = _ExportBuffers(layout)
            except NoRoom:
                return None
        return self._exports.named

    def _ensure(self, slot_bytes: int) -> _ShmFile:
        size = self.window * slot_bytes
        if self._slots is None or self._slots.size < size:
            if self._slots is not None:
                self._slots.close()
                self._slots = None
            self._slots = _ShmFile(size)
        return self._slots

    def stage(self, slot: int, slot_bytes: int, plan: BucketPlan, tensors: Sequence[torch.Tensor]) -> tuple[dict[str, Any], list[Any]]:
        if self._exports is not None and (at := self._exports.offset_of(plan, tensors)) is not None:
            return {"path": self._exports.file.path, "size": self._exports.file.size, "offset": at}, []
        # The slot stride is the file's, fixed when it was made: a later, smaller plan reuses it.
        try:
            slots = self._ensure(slot_bytes)
        except NoRoom as exc:
            raise WeightTransferError(f"{plan.describe()}: {exc}", bucket=plan.index) from exc
        stride = slots.size // self.window
        pack_into(slots.buf[slot * stride : slot * stride + plan.nbytes], plan, tensors)
        return {"path": slots.path, "size": slots.size, "offset": slot * stride}, []

    def after_send(self, slot: int, plan: BucketPlan) -> None:
        pass

    def close(self) -> None:
        for f in (self._slots, self._exports.file if self._exports is not None else None):
            if f is not None:
                f.close()
        self._slots = self._exports = None


class ShmReader:
    name = "shm"

    def __init__(self) -> None:
        self._maps: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}

    def read(self, header: dict[str, Any], plan: BucketPlan, frames: Sequence[Any]) -> Named:
        path, size, offset = header["path"], int(header["size"]), int(header["offset"])
        if path not in self._maps:
            if len(self._maps) >= 2:  # the sender's slots and export buffers; any older one is gone
                del self._maps[next(iter(self._maps))]
            fd = os.open(path, os.O_RDONLY)
            try:
                mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
            self._maps[path] = (mm, _frombuffer(mm, torch.uint8))
        self._maps[path] = self._maps.pop(path)  # most recently used last
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
    # A bucket in one multipart message reaches the receiver only whole: it would wait for all of
    # it before loading its first tensor, and the last bucket's load would overlap nothing.
    streams_frames = True

    def stage(self, slot: int, slot_bytes: int, plan: BucketPlan, tensors: Sequence[torch.Tensor]) -> tuple[dict[str, Any], list[Any]]:
        return {}, [_as_bytes(t) for t in tensors]

    def after_send(self, slot: int, plan: BucketPlan) -> None:
        pass

    def close(self) -> None:
        pass


class TcpReader:
    name = "tcp"

    def read(self, header: dict[str, Any], plan: BucketPlan, frames: Iterable[Any]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor as its frame is taken from ``frames`` (one frame per tensor, in order)."""
        count = header.get("frames", len(frames) if isinstance(frames, Sized) else len(plan.tensors))
        if count != len(plan.tensors):
            raise ValueError(f"{plan.describe()}: {count} data frames for {len(plan.tensors)} tensors")
        frames = iter(frames)
        for spec in plan.tensors:
            frame = next(frames, None)
            if frame is None:
                raise ValueError(f"{plan.describe()}: the data frames ended before {spec.name!r}")
            buf = frame.buffer if hasattr(frame, "buffer") else frame
            if len(buf) != spec.nbytes:
                raise ValueError(f"{plan.describe()}: {spec.name!r} arrived with {len(buf)} bytes, expected {spec.nbytes}")
            dtype = DTYPES[spec.dtype]
            t = _frombuffer(buf, dtype) if spec.nbytes else torch.empty(0, dtype=dtype)
            yield spec.name, t.view(spec.shape)

    def close(self) -> None:
        pass


class IpcPlane(TcpPlane):
    """``tcp``'s frames over the sender's ipc:// (unix socket) endpoint: one machine, no tcp stack."""

    name = "ipc"


class IpcReader(TcpReader):
    name = "ipc"
