"""``weight_sync``: how new weights travel from the trainer ranks into the engines."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class WeightSyncConfig(Section):
    # "auto": shared memory when the engine runs on the sender's machine, ZeroMQ tcp otherwise;
    # "ipc": the tcp frames over a unix socket (one machine; measured slower than shm here).
    # "collective": a broadcast group of trainer rank 0 and every engine worker (NCCL on GPUs;
    # needs a GPU per member: untested here, where gloo on CPU tests the same logic).
    # "cuda_ipc": GPU buffers shared by CUDA IPC handles, one machine.
    transport: Literal["auto", "shm", "ipc", "tcp", "collective", "cuda_ipc"] = "auto"
    # Bound on one bucket; memory on each side is at most ``window`` buckets (a decoder layer
    # larger than a bucket gets one of its own). Calibrated, not chosen: with one 256 MB bucket
    # the receiver's copy into the parameters cannot overlap the socket, and tcp took 2.0-2.2x
    # raw loopback for SmolLM2; 8-128 MB buckets took 1.2-1.8x (64 MB: 1.47x in both sweeps)
    # while shm stayed at 0.18-0.23 of a file round trip (`python -m benchmarks.weight_sync
    # --sweep-mb 8,16,32,64`, benchmarks/README.md).
    bucket_mb: float = Field(64.0, gt=0)
    window: int = Field(2, ge=1)  # buckets in flight: the next is staged while the engine loads the last
    timeout_s: float = Field(300.0, gt=0)  # per bucket and per hand-shake
    retries: int = Field(1, ge=0)  # whole-version retries after a failed sync
    # Keep a CPU copy of the last whole version in every engine worker so a failed sync restores
    # it (costs one model copy of memory and one memcpy per sync); without it a failed engine
    # stays paused until a sync completes.
    keep_previous: bool = False

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)
