"""Trainer side: stream one version, bucket by bucket, to every receiver at once.

Control runs over one ZeroMQ ROUTER socket the sender binds (receivers connect and say hello);
a bucket's bytes go by the data plane each receiver chose in its hello. The sender stays at most
``window`` buckets ahead of the slowest receiver: while receivers load bucket i it stages
bucket i+1 (pipelining) and memory stays bounded. Blocking by design: it runs in a trainer rank
(an actor method or a worker thread).

Messages (JSON header frame, then data frames):
  receiver -> sender: hello {sync, version, plane, name}; ack {sync, bucket}; error {sync, bucket,
  message}; done {sync}
  sender -> receiver: bucket {sync, version, bucket, of, **plane fields} + frames; end {sync};
  abort {sync, message}. A plane that streams its frames (tcp, ipc) sends the bucket header with
  ``frames: n`` and no frames, then n data messages, each an empty frame and one tensor's bytes.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from .base import DataPlane, WeightTransferError
from .buckets import BucketPlan, plan_buckets, slot_bytes
from .planes import IpcPlane, Layout, ShmPlane, TcpPlane, machine_id, shm_dir


@dataclass(frozen=True)
class SendReport:
    version: int
    num_tensors: int
    bytes: int
    buckets: int
    receivers: int
    seconds: float


class WeightSender:
    """Bind once (at trainer set-up); ``send`` a version whenever the engines should load one.

    ``source()`` is what receivers need to connect (it is small, JSON-able metadata: the driver
    passes it to the engines)."""

    def __init__(self, ctx: zmq.Context, *, host: str = "127.0.0.1", bucket_bytes: int = 256 << 20,
                 window: int = 2, timeout_s: float = 300.0, extra_planes: Iterable[DataPlane] = ()) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.bucket_bytes, self.window, self.timeout_s = int(bucket_bytes), window, timeout_s
        self.host = host
        self._cancelled = False
        self.planes: dict[str, DataPlane] = {"shm": ShmPlane(window), "tcp": TcpPlane(), "ipc": IpcPlane()}
        self.planes.update({p.name: p for p in extra_planes})
        self._layout: Layout | None = None  # the last version sent, when on the CPU and read over shm
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # No message limit: a ROUTER drops what it cannot queue, and streamed frames are a message
        # per tensor; what is in flight is bounded by ``window`` buckets, held zero-copy.
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self.endpoint = f"tcp://{host}:{self._sock.bind_to_random_port(f'tcp://{host}')}"
        self._ipc_path = os.path.join(shm_dir(), f"psrl-weights-{uuid.uuid4().hex[:12]}.sock")
        self._sock.bind(f"ipc://{self._ipc_path}")

    def source(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "ipc_endpoint": f"ipc://{self._ipc_path}", "machine": machine_id(),
                "planes": sorted(self.planes)}

    def add_plane(self, plane: DataPlane) -> None:
        """A plane set up after the sender (the collective group, CUDA IPC buffers)."""
        old = self.planes.get(plane.name)
        if old is not None:
            old.close()
        self.planes[plane.name] = plane

    def export_buffers(self) -> dict[str, torch.Tensor] | None:
        """Shared-memory tensors shaped as the last version sent, for the trainer to export the
        next version into: the shm plane then sends them as they lie (no copy into its slots),
        and the tcp plane's frames are their memory as always. None before a first send, when
        no receiver of the last one read shared memory, when that version was not on the CPU
        (GPU tensors go by CUDA IPC or a collective), or when /dev/shm has no room for it.

        The tensors stay the same from version to version: write the next version into them
        only after ``send`` of the last returned (a receiver may still be reading them)."""
        if self._layout is None:
            return None
        shm = self.planes["shm"]
        assert isinstance(shm, ShmPlane)
        named = shm.export_buffers(self._layout)
        return dict(named) if named is not None else None

    def cancel(self) -> None:
        """From another thread: make a ``send`` in progress fail now (a retry is about to start)."""
        self._cancelled = True

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *, receivers: int, sync: str) -> SendReport:
        """Stream ``named_tensors`` as ``version`` to ``receivers`` receivers that connect with
        the same ``sync`` id. Raises ``WeightTransferError`` naming the bucket on any failure
        (after telling every receiver to abort)."""
        start = time.perf_counter()
        self._cancelled = False
        named = [(n, t.detach()) for n, t in named_tensors]
        plans = plan_buckets(named, self.bucket_bytes)
        by_name = dict(named)
        slot_b = slot_bytes(plans)
        deadline = time.monotonic() + self.timeout_s
        peers: dict[bytes, str] = {}  # identity -> plane
        acked: dict[bytes, int] = {}
        try:
            while len(peers) < receivers:
                self._handle(self._recv(deadline, "receivers to connect", None), sync, version, peers, acked, None)
            # Export buffers pay off for shm receivers only (tcp frames are any tensor's memory).
            shm_cpu = "shm" in peers.values() and all(t.device.type == "cpu" for _, t in named)
            self._layout = [(s.name, s.dtype, s.shape) for p in plans for s in p.tensors] if shm_cpu else None
            by_plane: dict[str, list[bytes]] = {}
            for ident, plane in peers.items():
                by_plane.setdefault(plane, []).append(ident)
            for plan in plans:
                deadline = time.monotonic() + self.timeout_s
                while min(acked.values()) < plan.index - self.window:
                    self._handle(self._recv(deadline, "acks", plans[min(acked.values()) + 1]), sync, version, peers, acked, plans)
                slot = plan.index % self.window
                tensors = [by_name[s.name] for s in plan.tensors]
                for plane_name, idents in by_plane.items():
                    plane = self.planes[plane_name]
                    fields, frames = plane.stage(slot, slot_b, plan, tensors)
                    streams = plane.streams_frames
                    header = json.dumps({"type": "bucket", "sync": sync, "version": version, "bucket": plan.to_wire(),
                                         "of": len(plans), **fields, **({"frames": len(frames)} if streams else {})}).encode()
                    for ident in idents:
                        if not streams:
                            self._sock.send_multipart([ident, header, *frames], copy=False)
                            continue
                        self._sock.send_multipart([ident, header], copy=False)
                        for frame in frames:
                            self._sock.send_multipart([ident, b"", frame], copy=False)
                    plane.after_send(slot, plan)
            deadline = time.monotonic() + self.timeout_s
            while min(acked.values()) < len(plans) - 1:
                self._handle(self._recv(deadline, "acks", plans[min(acked.values()) + 1]), sync, version, peers, acked, plans)
            end = json.dumps({"type": "end", "sync": sync}).encode()
            for ident in peers:
                self._sock.send_multipart([ident, end])
            done: set[bytes] = set()
            while len(done) < len(peers):
                msg = self._recv(deadline, "receivers to finish", None)
                if self._handle(msg, sync, version, peers, acked, plans) == "done":
                    done.add(msg[0])
        except WeightTransferError as exc:
            abort = json.dumps({"type": "abort", "sync": sync, "message": str(exc)}).encode()
            for ident in peers:
                self._sock.send_multipart([ident, abort])
            raise
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        return SendReport(version, len(named), nbytes, len(plans), len(peers), time.perf_counter() - start)

    def _recv(self, deadline: float, waiting_for: str, plan: BucketPlan | None) -> list[Any]:
        at = f" at {plan.describe()}" if plan is not None else ""
        while not self._sock.poll(100):  # short polls: ``cancel`` is seen within 0.1 s
            if self._cancelled:
                raise WeightTransferError(f"weight sync cancelled while waiting for {waiting_for}{at}",
                                          bucket=plan.index if plan is not None else None)
            if time.monotonic() < deadline:
                continue
            raise WeightTransferError(f"weight sync timed out after {self.timeout_s:g}s waiting for {waiting_for}{at}",
                                      bucket=plan.index if plan is not None else None)
        return self._sock.recv_multipart()

    def _handle(self, msg: list[Any], sync: str, version: int, peers: dict[bytes, str], acked: dict[bytes, int],
                plans: list[BucketPlan] | None) -> str:
        ident, header = msg[0], json.loads(msg[1])
        if header.get("sync") != sync:  # left over from an earlier, failed attempt
            if header.get("type") == "hello":
                self._sock.send_multipart([ident, json.dumps({"type": "abort", "sync": header.get("sync"),
                                                              "message": "stale sync id"}).encode()])
            return "stale"
        match header:
            case {"type": "hello", "plane": str(plane), "version": int(v)}:
                if v != version or plane not in self.planes or plans is not None:
                    why = f"version {v} != {version}" if v != version else f"unknown plane {plane!r}"
                    raise WeightTransferError(f"receiver {header.get('name')!r} refused: {why}")
                peers[ident] = plane
                acked[ident] = -1
                return "hello"
            case {"type": "ack", "bucket": int(i)}:
                acked[ident] = max(acked.get(ident, -1), i)
                return "ack"
            case {"type": "error", "bucket": i, "message": str(message)}:
                where = plans[i].describe() if plans is not None and isinstance(i, int) and 0 <= i < len(plans) else "the sync"
                raise WeightTransferError(f"receiver {header.get('name')!r} failed at {where}: {message}",
                                          bucket=i if isinstance(i, int) else None)
            case {"type": "done"}:
                return "done"
        raise WeightTransferError(f"unexpected message from a weight receiver: {str(header)[:200]}")

    def close(self) -> None:
        for plane in self.planes.values():
            plane.close()
        self._sock.close(linger=0)
        try:
            os.unlink(self._ipc_path)
        except FileNotFoundError:
            pass

