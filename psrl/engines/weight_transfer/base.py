"""The seams of weight transfer: how a bucket's bytes travel, and how an engine loads them.

Contract every transport keeps: the receiver sees a version's buckets in order; a bucket's
tensors stay valid until the receiver asks for the next bucket (then its memory may be reused);
the sender never runs more than ``window`` buckets ahead of the slowest receiver, so memory on
both sides is bounded by ``window`` buckets. (The shm plane's export buffers hold a whole version,
but that is the trainer's export itself, written there instead of into memory of its own.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from .buckets import BucketPlan

Named = list[tuple[str, torch.Tensor]]


class WeightTransferError(RuntimeError):
    """A sync that did not complete. ``bucket`` is the bucket it failed on (None: before any);
    ``restored`` says whether the receiver put the previous whole version back."""

    def __init__(self, message: str, *, bucket: int | None = None, restored: bool = False) -> None:
        super().__init__(message)
        self.bucket = bucket
        self.restored = restored


@runtime_checkable
class DataPlane(Protocol):
    """Trainer side of a transport: puts a bucket where its receivers can read it.

    ``stage`` writes bucket ``plan`` into slot ``slot`` (or returns frames that carry it) and
    returns the fields to add to the bucket's header plus the frames to send after it;
    ``after_send`` runs once the header went to every receiver of this plane (the collective
    plane broadcasts there). A plane whose ``streams_frames`` is True has each frame sent as a
    message of its own after the header (a receiver loads a tensor as soon as it arrived, not
    once the whole bucket did); otherwise the frames travel in the header's message."""

    name: str
    streams_frames: bool

    def stage(self, slot: int, slot_bytes: int, plan: BucketPlan, tensors: Sequence[torch.Tensor]) -> tuple[dict[str, Any], list[Any]]: ...

    def after_send(self, slot: int, plan: BucketPlan) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class PlaneReader(Protocol):
    """Engine side of a transport: the tensors of a bucket, zero-copy where the plane allows.
    ``frames`` are the bucket's data frames; for a plane that streams them, an iterator that
    receives each as it comes, so ``read`` should take them one at a time (a generator) to let
    the loader start on the first tensor. A reader whose tensors are read asynchronously (a
    GPU's) may also define ``settle()``: the receiver calls it after the loader took a bucket,
    before the ack frees the sender's buffer."""

    name: str

    def read(self, header: dict[str, Any], plan: BucketPlan, frames: Iterable[Any]) -> Iterable[tuple[str, torch.Tensor]]: ...

    def close(self) -> None: ...


@runtime_checkable
class ParamLoader(Protocol):
    """Loads one version into an engine's parameters as its tensors stream in.

    ``load`` consumes the whole stream (HF names) and finishes the version (kernel repacking,
    caches); the stream raises ``WeightTransferError`` if the transport fails. After a failed
    ``load`` the model holds a mixture: ``restore`` puts the last whole version back and returns
    True, or returns False when it keeps no copy (the engine must then stay paused)."""

    def load(self, stream: Iterator[tuple[str, torch.Tensor]]) -> int: ...

    def restore(self) -> bool: ...
