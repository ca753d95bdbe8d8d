"""Engine side: pull a version's buckets from the sender(s) and load them as they arrive.

``receive(spec, loader, reader)`` runs where the parameters live (vLLM's worker, through
``psrl.engines.worker_ext``). The loader consumes a lazy stream: a bucket is acked (its memory
handed back to the sender) when the loader asks for the tensor after its last one, so the
sender fills the next slot while this one loads. ``spec`` is small JSON-able metadata:
``{"sync", "version", "sources": [sender.source(), ...], "timeout_s"}``; several sources (one
per pipeline stage) are read one after the other into one version.

On failure the receiver tells the sender which bucket failed, drains what is already in flight
(a collective plane needs every member at every broadcast), asks the loader to restore the
previous whole version, and raises ``WeightTransferError`` naming the bucket.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import zmq

from .base import ParamLoader, PlaneReader, WeightTransferError
from .buckets import BucketPlan
from .planes import choose_plane


MAX_KEPT_CONNECTIONS = 8  # senders a receiver stays connected to between syncs (oldest closed first)


class _Stream:
    def __init__(self, ctx: zmq.Context, spec: dict[str, Any], readers: Mapping[str, PlaneReader], name: str,
                 connections: dict[str, zmq.Socket] | None) -> None:
        self.ctx, self.spec, self.readers, self.name = ctx, spec, readers, name
        self.connections = connections
        self.endpoint = ""
        self.reader: PlaneReader = next(iter(readers.values()))
        self.sync, self.version = str(spec["sync"]), int(spec["version"])
        self.timeout_s = float(spec.get("timeout_s", 300.0))
        self.sock: zmq.Socket | None = None
        self.current: BucketPlan | None = None
        self.expected = 0
        self.buckets = 0
        self.finished = True  # the current source sent "end" (or none is open)

    def _send(self, **msg: Any) -> None:
        assert self.sock is not None
        self.sock.send(json.dumps({"sync": self.sync, "name": self.name, **msg}).encode())

    def _recv(self, what: str = "bucket") -> tuple[dict[str, Any], list[Any]]:
        """The next message: its JSON header and its frames; a streamed data message (an empty
        first frame) comes as ``{"type": "data"}`` with its frames."""
        assert self.sock is not None
        if not self.sock.poll(int(self.timeout_s * 1000)):
            raise WeightTransferError(
                f"timed out after {self.timeout_s:g}s waiting for {what} {self.expected} from the sender", bucket=self.expected
            )
        header, *frames = self.sock.recv_multipart(copy=False)
        if not len(header.buffer):
            return {"type": "data"}, frames
        return json.loads(bytes(header.buffer)), frames

    def _streamed(self, n: int) -> Iterator[Any]:
        """A streamed bucket's ``n`` data frames, each received when the reader asks for it."""
        for i in range(n):
            header, frames = self._recv(f"data frame {i + 1}/{n} of bucket")
            if header["type"] != "data" or len(frames) != 1:
                raise WeightTransferError(f"bucket {self.expected}: expected data frame {i + 1} of {n}, got a "
                                          f"{header.get('type')!r} message", bucket=self.expected)
            yield frames[0]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for source in self.spec["sources"]:
            self.reader = self.readers[choose_plane(source, self.spec.get("plane", "auto"), list(self.readers))]
            settle = getattr(self.reader, "settle", None)  # a GPU reader's copies must finish before an ack frees a slot
            self._connect(source["ipc_endpoint"] if self.reader.name == "ipc" else source["endpoint"])
            self.expected, self.finished = 0, False
            completed = False
            try:
                self._send(type="hello", version=self.version, plane=self.reader.name)
                while True:
                    header, frames = self._recv()
                    if header.get("sync") != self.sync:
                        continue
                    match header["type"]:
                        case "bucket":
                            plan = BucketPlan.from_wire(header["bucket"])
                            if plan.index != self.expected:
                                raise WeightTransferError(f"bucket {plan.index} arrived, expected {self.expected}", bucket=self.expected)
                            self.current = plan
                            data = self._streamed(int(header["frames"])) if "frames" in header else frames
                            yield from self.reader.read(header, plan, data)
                            if settle is not None:
                                settle()
                            del frames
                            self._send(type="ack", bucket=plan.index)
                            self.expected += 1
                            self.buckets += 1
                        case "end":
                            self.finished = completed = True
                            self._send(type="done")
                            break
                        case "abort":
                            self.finished = True
                            raise WeightTransferError(f"the sender aborted the sync at bucket {self.expected}: {header.get('message')}",
                                                      bucket=self.expected)
            finally:
                if self.finished:
                    self.close(keep=completed)

    def _connect(self, endpoint: str) -> None:
        """The connection to the sender at ``endpoint``: the one kept from an earlier sync, or a
        new one. Kept connections matter for tcp: a new one starts with small kernel windows
        that grow only with use, so its first tens of MB arrive at a fraction of the loopback's
        speed. Messages of an earlier sync still queued on it are skipped by their sync id."""
        self.endpoint = endpoint
        kept = self.connections.pop(endpoint, None) if self.connections is not None else None
        if kept is not None:
            self.sock = kept
            return
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)  # streamed frames: a message per tensor (the sender's window bounds them)
        self.sock.connect(endpoint)

    def fail(self, message: str) -> None:
        """Tell the sender, then take part in what it already sent until it aborts or ends."""
        if self.sock is None or self.finished:
            return
        bucket = self.current.index if self.current is not None else self.expected
        self._send(type="error", bucket=bucket, message=message)
        deadline = time.monotonic() + min(self.timeout_s, 60.0)
        while time.monotonic() < deadline:
            try:
                header, frames = self._recv()
            except WeightTransferError:
                break
            if header.get("type") == "bucket" and header.get("sync") == self.sync:
                try:
                    self.reader.read(header, BucketPlan.from_wire(header["bucket"]), frames)
                except Exception:  # draining only: the data is dropped either way
                    pass
            elif header.get("type") in ("abort", "end") and header.get("sync") == self.sync:
                break
        self.close()

    def close(self, keep: bool = False) -> None:
        """Done with the current sender; ``keep``: a sync completed on it, so the connection is
        kept for the next (where the caller keeps ``connections``)."""
        if self.sock is None:
            return
        if keep and self.connections is not None:
            self.connections[self.endpoint] = self.sock
            while len(self.connections) > MAX_KEPT_CONNECTIONS:
                self.connections.pop(next(iter(self.connections))).close(linger=0)
        else:
            self.sock.close(linger=0)
        self.sock = None


def receive(ctx: zmq.Context, spec: dict[str, Any], loader: ParamLoader, readers: Mapping[str, PlaneReader], *,
            name: str = "engine", connections: dict[str, zmq.Socket] | None = None) -> dict[str, Any]:
    """Load version ``spec["version"]``; returns ``{"version", "tensors", "buckets", "seconds"}``.
    ``spec["plane"]`` ("auto" by default) picks the reader per source (``choose_plane``).
    ``connections``: where a receiver that syncs again and again keeps its connections to the
    senders between syncs (the same dict every time; a connection is dropped after a failed
    sync); without it every sync connects anew."""
    start = time.perf_counter()
    stream = _Stream(ctx, spec, readers, name, connections)
    try:
        count = loader.load(iter(stream))
    except Exception as exc:
        where = stream.current.describe() if stream.current is not None else f"bucket {stream.expected}"
        bucket = stream.current.index if stream.current is not None else stream.expected
        if isinstance(exc, WeightTransferError) and exc.bucket is not None:
            bucket = exc.bucket
            where = f"bucket {bucket}"
        stream.fail(f"{type(exc).__name__}: {exc}")
        restored = False
        try:
            restored = loader.restore()
        except Exception as rexc:  # the engine then stays paused: a mixture is never served
            exc = WeightTransferError(f"{exc}; restoring the previous version failed too: {rexc}", bucket=bucket)
        state = "the previous version is restored" if restored else "the engine holds a partial update and stays paused"
        raise WeightTransferError(f"{name}: weight sync to version {stream.version} failed at {where}: "
                                  f"{type(exc).__name__}: {exc} ({state})", bucket=bucket, restored=restored) from exc
    finally:
        stream.close()
    return {"version": stream.version, "tensors": count, "buckets": stream.buckets, "seconds": time.perf_counter() - start}
