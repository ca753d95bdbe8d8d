"""Weight sync: after a step the trainer publishes HF-named tensors and a policy version.

- ``InProcessPublisher``: colocated engines; calls ``engine.update_weights`` on each.
- ``ZmqWeightPublisher`` -> ``ZmqWeightReceiver``: engines in other processes. One multipart
  message per update: a JSON metadata frame (version; name, dtype, shape per tensor) then one raw
  buffer frame per tensor, sent and received without copies; the receiver hands zero-copy tensors
  to its engine's ``update_weights`` and acks with the version (or an error message).

Both report bytes and seconds in a :class:`SyncReport`.
"""

from __future__ import annotations

import json
import time
import warnings
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


_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8,
)}


def pack(named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> list:
    """A metadata frame (names, dtypes, shapes) then one raw buffer frame per tensor, no copies
    beyond making a tensor contiguous on the CPU."""
    names, frames, entries = set(), [], []
    for name, t in named_tensors:
        if name in names:
            raise ValueError(f"weight {name!r} is given twice")
        names.add(name)
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise TypeError(f"weight {name!r}: dtype {t.dtype} cannot be sent")
        t = t.detach().to("cpu").contiguous()
        entries.append([name, dtype, list(t.shape)])
        frames.append(t.reshape(-1).view(torch.uint8).numpy())  # bf16 has no numpy dtype: send bytes
    if not entries:
        raise ValueError("a weight update needs at least one tensor")
    header = json.dumps({"type": "weights", "version": version, "tensors": entries}).encode()
    return [header, *frames]


def unpack(entries: list, buffers: Sequence) -> list[tuple[str, torch.Tensor]]:
    """Tensors over the received buffers, zero-copy and read-only: engines copy them into their
    own parameters when they load."""
    if len(entries) != len(buffers):
        raise ValueError(f"weight message has {len(entries)} tensors but {len(buffers)} buffers")
    out = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        for (name, dtype, shape), buf in zip(entries, buffers):
            flat = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.zeros(0, dtype=torch.uint8)
            out.append((name, flat.view(_DTYPES[dtype]).reshape(shape)))
    return out


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
        frames = pack(named_tensors, version)
        nbytes = sum(len(memoryview(f).cast("B")) for f in frames)
        with anyio.fail_after(self.timeout_s):
            for s in self._socks:
                await _send(s, frames)
            for s in self._socks:
                ack = json.loads(bytes((await _recv(s))[0].buffer))
                match ack:
                    case {"type": "applied", "version": v} if v == version:
                        pass
                    case {"type": "error", "message": msg}:
                        raise RuntimeError(f"weight receiver failed to apply version {version}: {msg}")
                    case _:
                        raise RuntimeError(f"unexpected answer from a weight receiver: {ack}")
        return SyncReport(version, len(frames) - 1, nbytes, time.perf_counter() - start, len(self._socks))

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
            ident, header, *buffers = await _recv(self._sock)
            try:
                meta = json.loads(bytes(header.buffer))
                match meta:
                    case {"type": "weights", "version": int(version), "tensors": list(entries)}:
                        named = unpack(entries, [b.buffer for b in buffers])
                        await self.engine.update_weights(named, version)
                        self.updates += 1
                        self.last_version = version
                        reply = {"type": "applied", "version": version}
                    case _:
                        reply = {"type": "error", "message": f"unknown message {str(meta)[:200]}"}
            except Exception as e:  # answer the publisher rather than leaving it waiting
                reply = {"type": "error", "message": f"{type(e).__name__}: {e}"}
            await _send(self._sock, [ident, json.dumps(reply).encode()])

    async def aclose(self) -> None:
        self._sock.close(linger=0)
