"""Weight sync: after a step the trainer publishes HF-named tensors and a policy version.

- ``InProcessPublisher``: colocated engines; calls ``engine.update_weights`` on each.
- ``ZmqWeightPublisher`` -> ``ZmqWeightReceiver``: engines in other processes. One message per
  update: a JSON header frame plus one safetensors frame; the receiver loads it into its engine
  and answers with an ack carrying the version and its own load time.

Both report bytes and seconds in a :class:`SyncReport`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import anyio
import torch
import zmq

from psrl.engines.base import InferenceEngine

_POLL_S = 0.05  # bound on one wait for the (edge-triggered) ZeroMQ descriptor


@dataclass(frozen=True)
class SyncReport:
    version: int
    num_tensors: int
    bytes: int
    seconds: float
    targets: int  # engines (or receivers) updated


@runtime_checkable
class WeightPublisher(Protocol):
    async def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncReport: ...

    async def aclose(self) -> None: ...


def _nbytes(named: Sequence[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


class InProcessPublisher:
    """Colocated engines: the same tensors are handed to every engine, concurrently."""

    def __init__(self, engines: Sequence[InferenceEngine]) -> None:
        self.engines = list(engines)

    async def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncReport:
        named = [(n, t.detach()) for n, t in named_tensors]
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for engine in self.engines:
                tg.start_soon(engine.update_weights, named, version)
        return SyncReport(version, len(named), _nbytes(named), time.perf_counter() - start, len(self.engines))

    async def aclose(self) -> None:
        pass


def pack(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[bytes, int]:
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    for name, t in named_tensors:
        if name in tensors:
            raise ValueError(f"weight {name!r} is given twice")
        tensors[name] = t.detach().to("cpu").contiguous().clone()  # no shared storage (tied weights)
    if not tensors:
        raise ValueError("a weight update needs at least one tensor")
    return save(tensors), len(tensors)


def unpack(blob: bytes | memoryview) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load

    return list(load(bytes(blob)).items())


async def _recv(sock: zmq.Socket) -> list[zmq.Frame]:
    fd = sock.getsockopt(zmq.FD)
    while True:
        try:
            return sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass
        # The descriptor only signals changes; a bounded wait keeps a missed edge from hanging.
        with anyio.move_on_after(_POLL_S):
            await anyio.wait_readable(fd)


async def _send(sock: zmq.Socket, frames: list) -> None:
    while True:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            return
        except zmq.Again:
            await anyio.sleep(0.001)


class ZmqWeightPublisher:
    """Sends each update to every receiver endpoint (``tcp://127.0.0.1:PORT``) and waits for acks."""

    def __init__(self, ctx: zmq.Context, endpoints: Sequence[str], *, timeout_s: float = 300.0) -> None:
        self._socks = []
        self.timeout_s = timeout_s
        for ep in endpoints:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            self._socks.append(s)

    async def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncReport:
        start = time.perf_counter()
        blob, count = pack(named_tensors)
        header = json.dumps({"type": "weights", "version": version, "num_tensors": count, "bytes": len(blob)}).encode()
        with anyio.fail_after(self.timeout_s):
            for s in self._socks:
                await _send(s, [header, blob])
            for s in self._socks:
                ack = json.loads(bytes((await _recv(s))[0].buffer))
                match ack:
                    case {"type": "applied", "version": v} if v == version:
                        pass
                    case {"type": "error", "message": msg}:
                        raise RuntimeError(f"weight receiver failed to apply version {version}: {msg}")
                    case _:
                        raise RuntimeError(f"unexpected answer from a weight receiver: {ack}")
        return SyncReport(version, count, len(blob), time.perf_counter() - start, len(self._socks))

    async def aclose(self) -> None:
        for s in self._socks:
            s.close(linger=0)
        self._socks.clear()


class ZmqWeightReceiver:
    """Engine side: ``await tg.start(receiver.serve)`` then updates arrive until ``aclose``."""

    def __init__(self, ctx: zmq.Context, engine: Any, *, host: str = "127.0.0.1") -> None:
        self.engine = engine
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.updates = 0
        self.last_version = -1

    async def serve(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self.endpoint)
        while True:
            ident, header, blob = await _recv(self._sock)
            try:
                meta = json.loads(bytes(header.buffer))
                match meta:
                    case {"type": "weights", "version": int(version)}:
                        named = unpack(blob.buffer)
                        await self.engine.update_weights(named, version)
                        self.updates += 1
                        self.last_version = version
                        reply = {"type": "applied", "version": version}
                    case _:
                        reply = {"type": "error", "message": f"unknown message {meta!r}"}
            except Exception as e:  # answer the publisher rather than leaving it waiting
                reply = {"type": "error", "message": f"{type(e).__name__}: {e}"}
            await _send(self._sock, [ident, json.dumps(reply).encode()])

    async def aclose(self) -> None:
        self._sock.close(linger=0)
