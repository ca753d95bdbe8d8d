"""The ``collective`` data plane: trainer rank 0 broadcasts each bucket to every engine worker.

The group is a process group of its own (a ``TCPStore`` rendezvous and a ``ProcessGroupGloo`` or
``ProcessGroupNCCL`` built directly), so it lives beside the trainer's and vLLM's default groups
without touching them. Rank 0 is the sender; engine workers take ranks ``first_rank + worker
rank`` (``psrl.engines.worker_ext.WeightUpdateExtension.psrl_init_collective``).

On CPU the backend is gloo, and that is what the tests here run. NCCL (``backend="nccl"``) is the
GPU path: it needs a GPU per member (the trainer's and each engine worker's), so at least two
GPUs, and has not been run on these machines.

Control still goes over the sender's ZeroMQ socket: a bucket's header reaches every member
first, then the bytes follow as one broadcast, so every member takes part in every broadcast in
the same order (a receiver whose load failed keeps taking part until the sender aborts).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from .buckets import BucketPlan, pack_into, views

Named = list[tuple[str, torch.Tensor]]


def new_group(rendezvous: dict[str, Any], rank: int, device: torch.device) -> Any:
    """Join the weight-broadcast group (blocks until all ``world`` members joined)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=float(rendezvous.get("timeout_s", 300.0)))
    world = int(rendezvous["world"])
    store = dist.TCPStore(rendezvous["host"], int(rendezvous["port"]), world, is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore(str(rendezvous.get("name", "psrl-weights")), store)
    backend = rendezvous.get("backend") or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    if backend == "nccl":  # untested here: needs one GPU per member
        torch.cuda.set_device(device)
        return dist.ProcessGroupNCCL(store, rank, world)
    raise ValueError(f"unknown weight-broadcast backend {backend!r} (gloo or nccl)")


def _broadcast(pg: Any, buf: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([buf], opts).wait()


class _Buffers:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bufs: dict[int, torch.Tensor] = {}

    def get(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self._bufs.get(slot)
        if buf is None or buf.numel() < nbytes:
            buf = self._bufs[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf


class CollectivePlane:
    """Sender side (rank 0). Build with ``join`` while the engines join with theirs."""

    name = "collective"
    streams_frames = False

    def __init__(self, pg: Any, device: torch.device) -> None:
        self.pg = pg
        self._bufs = _Buffers(device)

    @classmethod
    def join(cls, rendezvous: dict[str, Any], device: torch.device | None = None) -> CollectivePlane:
        device = device or torch.device("cpu")
        return cls(new_group(rendezvous, 0, device), device)

    def stage(self, slot: int, slot_bytes: int, plan: BucketPlan, tensors: Sequence[torch.Tensor]) -> tuple[dict[str, Any], list[Any]]:
        pack_into(self._bufs.get(slot, slot_bytes)[: plan.nbytes], plan, tensors)
        return {"slot": slot}, []

    def after_send(self, slot: int, plan: BucketPlan) -> None:
        _broadcast(self.pg, self._bufs.get(slot, plan.nbytes)[: plan.nbytes])

    def close(self) -> None:
        self.pg = None


class CollectiveReader:
    """Receiver side: takes part in the bucket's broadcast, then hands out views of it."""

    name = "collective"

    def __init__(self, pg: Any, device: torch.device) -> None:
        self.pg = pg
        self._bufs = _Buffers(device)

    @classmethod
    def join(cls, rendezvous: dict[str, Any], rank: int, device: torch.device) -> CollectiveReader:
        return cls(new_group(rendezvous, rank, device), device)

    def read(self, header: dict[str, Any], plan: BucketPlan, frames: Sequence[Any]) -> Named:
        # One buffer is enough: the next broadcast is joined only after this bucket was loaded.
        buf = self._bufs.get(0, plan.nbytes)[: plan.nbytes]
        _broadcast(self.pg, buf)
        return views(buf, plan)

    def close(self) -> None:
        self.pg = None
