"""``update_weights`` for an engine whose workers load streamed weights: the tensors this
process holds go through a ``WeightSender`` of the engine's own (shared memory, bucket by
bucket) into the engine's ``receive_weights``, so in-process callers and the trainer ranks use
one loading path."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import anyio

from .weights import check_update


class LocalSender:
    def __init__(self, bucket_bytes: int = 256 << 20) -> None:
        self.bucket_bytes = bucket_bytes
        self._sender: Any = None
        self._zmq: Any = None

    def _get(self) -> Any:
        if self._sender is None:
            import zmq

            from .weight_transfer.sender import WeightSender

            self._zmq = zmq.Context()
            self._sender = WeightSender(self._zmq, bucket_bytes=self.bucket_bytes)
        return self._sender

    async def update(self, engine: Any, named_tensors: Iterable[tuple[str, Any]], version: int,
                     shapes: Mapping[str, tuple[int, ...]], *, keep_previous: bool) -> None:
        """Raises ``ValueError``/``TypeError`` before anything loads if a tensor does not fit
        the served model (``shapes``); otherwise as ``engine.receive_weights``."""
        import torch

        named = list(named_tensors)
        for name, t in named:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"weight {name!r} is a {type(t).__name__}, expected a torch.Tensor")
        check_update({n: tuple(t.shape) for n, t in named}, dict(shapes))
        sender = self._get()
        sync = uuid.uuid4().hex
        spec = {"sync": sync, "version": int(version), "sources": [sender.source()], "plane": "auto",
                "timeout_s": sender.timeout_s, "keep_previous": keep_previous}

        async def send() -> None:
            try:
                await anyio.to_thread.run_sync(lambda: sender.send(named, version, receivers=engine.weight_receivers(), sync=sync))
            except Exception:
                pass  # the receiving side reports the failure, naming the bucket

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            try:
                await engine.receive_weights(spec, version)
            except BaseException:
                sender.cancel()
                raise

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None
