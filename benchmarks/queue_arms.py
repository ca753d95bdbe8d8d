"""The arms of ``psrl bench queue``: each times one round of the same workload when asked, so the
benchmark can interleave them (ABBA...) in one run.

- ``OursArm``: the TransferQueue in its own process (production settings: one storage unit, held
  by the controller's process), ``concurrency`` producers put every chunk, then as many consumers
  take batches with ``get_batch`` (what the trainer loop's ``take`` does).
- ``RawArm``: the same chunks over raw pyzmq zero-copy PUSH/PULL through a store-and-forward relay
  process: the same two process crossings (producer -> relay -> consumer), nothing else. The relay
  keeps freed memory as our service process does (else glibc maps and unmaps each received
  buffer: ~350 page faults a round).
- ``PeerArm``: PyPI ``transferqueue`` driven over a pipe (``benchmarks/peer_transferqueue.py``
  in its own venv).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import numpy as np
import psutil
import pyarrow as pa
import zmq

from psrl.allocator import keep_freed_memory
from psrl.config import TransferQueueConfig
from psrl.trajectory import DERIVED_FIELDS, TOKEN_FIELDS, numpy_list_array
from psrl.transfer_queue import start_transfer_queue
from psrl.transfer_queue.columns import min_versions

TOKENS = ["response_ids", "logprobs", "loss_mask", "versions"]
# What every arm carries: the token columns and the scalar ``min_version`` that production's
# ``to_arrow`` derives as it builds a batch (the queue reads it at put; without it a put scans
# the versions tokens, a path production never takes).
FIELDS = [*TOKENS, "min_version"]


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes so far, all their threads."""
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def make_workload(n: int, tokens: int, seed: int = 0) -> pa.RecordBatch:
    rng = np.random.default_rng(seed)
    cols = {
        "response_ids": rng.integers(0, 150_000, (n, tokens), dtype=np.int32),
        "logprobs": -rng.random((n, tokens), dtype=np.float32),
        "loss_mask": np.ones((n, tokens), np.int8),
        "versions": np.zeros((n, tokens), np.int32),
    }
    arrays = [pa.array([f"s{i}" for i in range(n)], pa.string())]
    lists = {f: numpy_list_array(list(cols[f]), TOKEN_FIELDS[f]) for f in TOKENS}
    arrays += [*lists.values(), pa.array(min_versions(lists["versions"]).astype(np.int32), DERIVED_FIELDS["min_version"])]
    return pa.RecordBatch.from_arrays(arrays, names=["key", *FIELDS])


def payload_bytes(batch: pa.RecordBatch) -> int:
    """Bytes of the carried columns' values (the token values and the scalar column)."""
    return sum(batch.column(f).values.nbytes for f in TOKENS) + batch.column("min_version").nbytes


class OursArm:
    def __init__(self, transport: str, batch: pa.RecordBatch, chunk: int, concurrency: int):
        self.transport, self.concurrency = transport, concurrency
        self.chunks = [batch.slice(i, chunk) for i in range(0, batch.num_rows, chunk)]
        self.capacity = batch.num_rows * 2
        self.rounds = 0

    async def open(self, stack: AsyncExitStack) -> None:
        cfg = TransferQueueConfig(transport=self.transport, storage_units=1, capacity_samples=self.capacity, request_timeout_s=120)
        handle = await stack.enter_async_context(start_transfer_queue(cfg))
        self.pid = handle.pids["controller"]
        self.pids = [os.getpid(), self.pid]  # the benchmark's process and the queue's
        self.cpu: list[float] = []  # CPU seconds of each round's timed window
        self.q = await stack.enter_async_context(handle.connect())

    async def round(self) -> float:
        part = f"r{self.rounds}"
        self.rounds += 1
        # Fresh keys every round (the key column is tiny; the token columns stay the same buffers).
        chunks = [c.set_column(0, "key", pa.array([f"{part}-{k}" for k in c.column(0).to_pylist()])) for c in self.chunks]
        q, todo = self.q, list(range(len(chunks)))

        async def produce() -> None:
            while todo:
                await q.batch_put(chunks[todo.pop()], partition=part)

        async def consume() -> None:
            while todo:
                size = chunks[todo.pop()].num_rows
                _, data = await q.get_batch(part, size, FIELDS, consumer="bench")
                assert data.num_rows == size

        c0, t0 = cpu_seconds(self.pids), time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(self.concurrency):
                tg.start_soon(produce)
        todo = list(range(len(chunks)))
        async with anyio.create_task_group() as tg:
            for _ in range(self.concurrency):
                tg.start_soon(consume)
        seconds = time.perf_counter() - t0
        self.cpu.append(cpu_seconds(self.pids) - c0)
        await q.clear(part)
        return seconds


def _relay(ep_in: str, ep_out: str, messages: int) -> None:
    keep_freed_memory()  # as our queue's service process does: each arm in its fastest mode
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for s in (pull, push):
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
    pull.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.LINGER, 30_000)  # the last round must reach the consumer before we exit
    pull.connect(ep_in)
    push.connect(ep_out)
    while True:
        first = pull.recv_multipart(copy=False)
        if len(first) == 1 and first[0].bytes == b"stop":
            break
        held = [first] + [pull.recv_multipart(copy=False) for _ in range(messages - 1)]
        push.send(b"ack")
        assert pull.recv() == b"go"
        for m in held:
            push.send_multipart(m, copy=False)
        del held
    pull.close()
    push.close()
    ctx.term()


class RawArm:
    """Blocking: run ``round`` in a worker thread."""

    def __init__(self, transport: str, batch: pa.RecordBatch, chunk: int):
        self.tmp = tempfile.mkdtemp(prefix="psrl-bench-")
        self.ctx = zmq.Context()
        self.push, self.pull = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        for s in (self.push, self.pull):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
        if transport == "ipc":
            ep_in, ep_out = f"ipc://{self.tmp}/in", f"ipc://{self.tmp}/out"
            self.push.bind(ep_in)
            self.pull.bind(ep_out)
        else:
            ep_in = f"tcp://127.0.0.1:{self.push.bind_to_random_port('tcp://127.0.0.1')}"
            ep_out = f"tcp://127.0.0.1:{self.pull.bind_to_random_port('tcp://127.0.0.1')}"
        # The same chunks as ours, each as one multipart message of its offsets and values buffers
        # and the scalar column.
        self.messages = []
        for i in range(0, batch.num_rows, chunk):
            part = batch.slice(i, chunk)
            frames = []
            for f in TOKENS:
                col = part.column(f)
                off = col.offsets.to_numpy()
                frames.append(off - off[0])
                width = col.values.type.bit_width // 8
                frames.append(col.values.buffers()[1].slice(int(off[0]) * width, int(off[-1] - off[0]) * width))
            frames.append(part.column("min_version").to_numpy())
            self.messages.append(frames)
        self.proc = multiprocessing.get_context("spawn").Process(
            target=_relay, args=(ep_in, ep_out, len(self.messages)), daemon=True
        )
        self.proc.start()
        self.pids = [os.getpid(), self.proc.pid]  # the benchmark's process and the relay
        self.cpu: list[float] = []  # CPU seconds of each round's timed window

    def round(self) -> float:
        c0, t0 = cpu_seconds(self.pids), time.perf_counter()
        for m in self.messages:
            self.push.send_multipart(m, copy=False)
        assert self.pull.recv() == b"ack"
        self.push.send(b"go")
        got = [self.pull.recv_multipart(copy=False) for _ in self.messages]
        seconds = time.perf_counter() - t0
        self.cpu.append(cpu_seconds(self.pids) - c0)
        assert len(got) == len(self.messages)
        return seconds

    def close(self) -> None:
        try:
            self.push.send(b"stop")
            self.proc.join(10)
        finally:
            if self.proc.is_alive():
                self.proc.kill()
            self.push.close()
            self.pull.close()
            self.ctx.term()
            shutil.rmtree(self.tmp, ignore_errors=True)


class PeerArm:
    """Blocking: run ``round`` / ``meta`` in a worker thread."""

    def __init__(
        self, python: str, *, n: int, tokens: int, chunk: int, concurrency: int, meta_batches: int, units: int,
        timeout_s: float = 600.0,
    ):
        script = Path(__file__).with_name("peer_transferqueue.py")
        env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", PYTHONPATH="", RAY_raylet_start_wait_time_s="180")
        self.log = tempfile.TemporaryFile("w+")  # Ray is chatty: a pipe nobody reads would fill up
        self.proc = subprocess.Popen(
            [python, str(script), "--n", str(n), "--tokens", str(tokens), "--chunk", str(chunk),
             "--concurrency", str(concurrency), "--meta-batches", str(meta_batches), "--units", str(units)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
            cwd=tempfile.gettempdir(),
        )
        # Its answers are read by a thread, so an answer that never comes (a Ray actor killed
        # under memory pressure leaves its client waiting forever) times out here.
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.info = self._answer(timeout_s)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def _answer(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"the peer did not answer within {timeout_s:g} s") from None
            if not line:
                self.proc.wait(30)
                self.log.seek(0)
                err = self.log.read()[-800:]
                raise RuntimeError(f"the peer process ended (rc {self.proc.poll()}): {err}")
            if line.startswith("{"):
                out = json.loads(line)
                if "error" in out:
                    raise RuntimeError(f"peer: {out['error']}")
                return out

    def ask(self, command: str, timeout_s: float = 600.0) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._answer(timeout_s)

    def round(self) -> float:
        return float(self.ask("round")["seconds"])

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            self.log.close()
