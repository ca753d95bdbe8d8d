"""A factory that starts a real queue (real ZeroMQ sockets) for a config."""

from __future__ import annotations

from contextlib import asynccontextmanager

from psrl.config import TransferQueueConfig
from psrl.transfer_queue import start_transfer_queue


def queue_factory(transport: str, *, in_process: bool = True, units: int = 2, **overrides):
    @asynccontextmanager
    async def factory(cfg: TransferQueueConfig):
        cfg = cfg.model_copy(update={
            "transport": transport, "in_process": in_process, "storage_units": units,
            "request_timeout_s": 10.0, "wait_slice_s": 0.5, **overrides,
        })
        async with start_transfer_queue(cfg) as handle, handle.connect() as client:
            yield client

    return factory
