"""``psrl bench queue``: TransferQueue throughput and latency against raw ZeroMQ and the peer.

Workload: 1,000 trajectories x 2,048 tokens (response ids int32, log-probs float32, loss mask
int8, versions int32: 26.6 MB), put in chunks of ``--chunk`` trajectories, then fetched back.

- ``ipc_gbps`` / ``tcp_gbps``: payload bytes / (time to put every chunk + time to take and
  fetch them all), ``--concurrency`` producers then as many consumers at once. The benchmark
  process is producer and consumer; the controller and storage unit are separate processes, so
  every byte crosses two process boundaries (producer -> unit -> consumer).
- ``raw_*_gbps``: the same bytes in the same chunks over raw pyzmq zero-copy PUSH/PULL through a
  store-and-forward relay process (producer -> relay, then relay -> consumer): the same two
  crossings with nothing else. ``ratio`` = ipc / raw ipc.
- ``get_meta_p50_ms`` / ``p99``: round trip of ``get_meta`` for 1,024-sample batches with
  ~100k samples' metadata in the controller.
- ``controller_rss_mb_1m``: resident memory of the controller process holding 1,000,000
  samples' metadata (key, group, reward readiness).
- ``transferqueue_*``: the peer (PyPI ``transferqueue``, on Ray) on the same workload, run by
  ``benchmarks/peer_transferqueue.py`` in its own venv (``benchmarks/setup_peer_venv.sh``;
  ``PSRL_PEER_PYTHON`` or ``--peer-python``); null when that venv is missing or the run fails.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import numpy as np
import pyarrow as pa
import zmq

from psrl.config import TransferQueueConfig
from psrl.trajectory import TOKEN_FIELDS, numpy_list_array
from psrl.transfer_queue import start_transfer_queue

FIELDS = ["response_ids", "logprobs", "loss_mask", "versions"]
DEFAULT_PEER_PYTHON = "/work/peer-venv/bin/python"


def make_workload(n: int, tokens: int, seed: int = 0) -> pa.RecordBatch:
    rng = np.random.default_rng(seed)
    cols = {
        "response_ids": rng.integers(0, 150_000, (n, tokens), dtype=np.int32),
        "logprobs": -rng.random((n, tokens), dtype=np.float32),
        "loss_mask": np.ones((n, tokens), np.int8),
        "versions": np.zeros((n, tokens), np.int32),
    }
    arrays = [pa.array([f"s{i}" for i in range(n)], pa.string())]
    arrays += [numpy_list_array(list(cols[f]), TOKEN_FIELDS[f]) for f in FIELDS]
    return pa.RecordBatch.from_arrays(arrays, names=["key", *FIELDS])


def payload_bytes(batch: pa.RecordBatch) -> int:
    return sum(batch.column(f).values.nbytes for f in FIELDS)


# ---- ours --------------------------------------------------------------------------------------

async def _ours(transport: str, batch: pa.RecordBatch, chunk: int, rounds: int, concurrency: int) -> float:
    """``concurrency`` producers put chunks at once, then as many consumers take and fetch
    batches at once (requests pipeline on the client's sockets, as the raw baseline's do)."""
    cfg = TransferQueueConfig(
        transport=transport, storage_units=1, capacity_samples=batch.num_rows * 2, request_timeout_s=60,
    )
    nbytes, n = payload_bytes(batch), batch.num_rows
    chunks = [batch.slice(i, chunk) for i in range(0, n, chunk)]
    best = 0.0
    async with start_transfer_queue(cfg) as handle, handle.connect() as q:
        for r in range(rounds + 1):  # round 0 warms up
            part = f"r{r}"
            todo = list(range(len(chunks)))

            async def produce() -> None:
                while todo:
                    await q.batch_put(chunks[todo.pop()], partition=part)

            async def consume() -> None:
                while todo:
                    size = chunks[todo.pop()].num_rows
                    meta = await q.get_meta(part, size, FIELDS, consumer="bench")
                    data = await q.get_data(meta, FIELDS)
                    assert data.num_rows == size

            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for _ in range(concurrency):
                    tg.start_soon(produce)
            todo = list(range(len(chunks)))
            async with anyio.create_task_group() as tg:
                for _ in range(concurrency):
                    tg.start_soon(consume)
            t2 = time.perf_counter()
            await q.clear(part)
            if r:
                best = max(best, nbytes / (t2 - t0) / 1e9)
    return best


# ---- raw pyzmq baseline --------------------------------------------------------------------------

def _relay(ep_in: str, ep_out: str, messages: int, rounds: int) -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for s in (pull, push):
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
    pull.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.LINGER, 30_000)  # the last round must reach the consumer before we exit
    pull.connect(ep_in)
    push.connect(ep_out)
    for _ in range(rounds + 1):
        held = [pull.recv_multipart(copy=False) for _ in range(messages)]
        push.send(b"ack")
        assert pull.recv() == b"go"
        for m in held:
            push.send_multipart(m, copy=False)
        del held
    pull.close()
    push.close()
    ctx.term()


def _raw(transport: str, batch: pa.RecordBatch, chunk: int, rounds: int) -> float:
    tmp = tempfile.mkdtemp(prefix="psrl-bench-")
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    for s in (push, pull):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
    if transport == "ipc":
        ep_in, ep_out = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
        push.bind(ep_in)
        pull.bind(ep_out)
    else:
        ep_in = f"tcp://127.0.0.1:{push.bind_to_random_port('tcp://127.0.0.1')}"
        ep_out = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    # The same chunks as the queue run, each as one multipart message of its buffers.
    messages = []
    for i in range(0, batch.num_rows, chunk):
        part = batch.slice(i, chunk)
        frames = []
        for f in FIELDS:
            col = part.column(f)
            off = col.offsets.to_numpy()
            frames.append(off - off[0])
            width = col.values.type.bit_width // 8
            frames.append(col.values.buffers()[1].slice(int(off[0]) * width, int(off[-1] - off[0]) * width))
        messages.append(frames)
    proc = multiprocessing.get_context("spawn").Process(target=_relay, args=(ep_in, ep_out, len(messages), rounds), daemon=True)
    proc.start()
    best = 0.0
    try:
        nbytes = payload_bytes(batch)
        for r in range(rounds + 1):
            t0 = time.perf_counter()
            for m in messages:
                push.send_multipart(m, copy=False)
            assert pull.recv() == b"ack"
            push.send(b"go")
            t1 = time.perf_counter()
            got = [pull.recv_multipart(copy=False) for _ in messages]
            t2 = time.perf_counter()
            assert len(got) == len(messages)
            if r:
                best = max(best, nbytes / ((t1 - t0) + (t2 - t1)) / 1e9)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        push.close()
        pull.close()
        ctx.term()
        shutil.rmtree(tmp, ignore_errors=True)
    return best


# ---- get_meta latency, controller memory ------------------------------------------------------------

async def _get_meta_latency(batches: int) -> tuple[float, float]:
    cfg = TransferQueueConfig(transport="ipc", storage_units=1, capacity_samples=2_000_000, request_timeout_s=60)
    async with start_transfer_queue(cfg) as handle, handle.connect() as q:
        for b in range(batches):
            keys = [f"m{b}-{i}" for i in range(1024)]
            await q.batch_put({"key": keys, "group_id": [f"g{b}-{i // 8}" for i in range(1024)], "reward": np.zeros(1024)})
        times = []
        for _ in range(batches):
            t0 = time.perf_counter()
            meta = await q.get_meta("train", 1024, ["reward"], consumer="bench")
            times.append((time.perf_counter() - t0) * 1e3)
            assert len(meta) == 1024
    return float(np.percentile(times, 50)), float(np.percentile(times, 99))


async def _controller_rss(samples: int, per_put: int = 20_000) -> float:
    import psutil

    cfg = TransferQueueConfig(transport="ipc", storage_units=1, capacity_samples=samples, request_timeout_s=120)
    async with start_transfer_queue(cfg) as handle, handle.connect() as q:
        for start in range(0, samples, per_put):
            n = min(per_put, samples - start)
            await q.batch_put({
                "key": [f"sample-{start + i:09d}" for i in range(n)],
                "group_id": [f"group-{(start + i) // 8:08d}" for i in range(n)],
                "reward": np.zeros(n),
            })
        stats = await q.statistics()
        assert stats.samples == samples
        return psutil.Process(handle.pids["controller"]).memory_info().rss / 2**20


# ---- peer ----------------------------------------------------------------------------------------

def _peer(python: str, n: int, tokens: int, chunk: int, rounds: int) -> tuple[dict | None, str]:
    if not Path(python).exists():
        return None, f"no peer venv at {python} (run benchmarks/setup_peer_venv.sh)"
    script = Path(__file__).with_name("peer_transferqueue.py")
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", PYTHONPATH="")
    try:
        out = subprocess.run(
            [python, str(script), "--n", str(n), "--tokens", str(tokens), "--chunk", str(chunk), "--rounds", str(rounds)],
            capture_output=True, text=True, timeout=900, env=env, cwd=tempfile.gettempdir(),
        )
    except subprocess.TimeoutExpired:
        return None, "peer run timed out"
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        return None, f"peer run failed (rc {out.returncode}): {(out.stderr or out.stdout)[-800:]}"
    return json.loads(lines[-1]), ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="psrl bench queue", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1000, help="trajectories")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per trajectory")
    ap.add_argument("--chunk", type=int, default=100, help="trajectories per put / per get")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (best is reported)")
    ap.add_argument("--concurrency", type=int, default=4, help="concurrent producers, then consumers (ours)")
    ap.add_argument("--meta-batches", type=int, default=100, help="1,024-sample get_meta calls timed")
    ap.add_argument("--rss-samples", type=int, default=1_000_000)
    ap.add_argument("--peer-python", default=os.environ.get("PSRL_PEER_PYTHON", DEFAULT_PEER_PYTHON))
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    batch = make_workload(args.n, args.tokens)
    res: dict[str, float | None] = {}
    res["ipc_gbps"] = anyio.run(_ours, "ipc", batch, args.chunk, args.rounds, args.concurrency)
    res["tcp_gbps"] = anyio.run(_ours, "tcp", batch, args.chunk, args.rounds, args.concurrency)
    res["raw_ipc_gbps"] = _raw("ipc", batch, args.chunk, args.rounds)
    res["raw_tcp_gbps"] = _raw("tcp", batch, args.chunk, args.rounds)
    res["ratio"] = res["ipc_gbps"] / res["raw_ipc_gbps"]
    res["get_meta_p50_ms"], res["get_meta_p99_ms"] = anyio.run(_get_meta_latency, args.meta_batches)
    res["controller_rss_mb_1m"] = anyio.run(_controller_rss, args.rss_samples)
    peer, why = (None, "skipped (--no-peer)") if args.no_peer else _peer(args.peer_python, args.n, args.tokens, args.chunk, args.rounds)
    res["transferqueue_gbps"] = peer["gbps"] if peer else None
    res["vs_transferqueue"] = res["ipc_gbps"] / peer["gbps"] if peer and peer["gbps"] else None
    res["transferqueue_meta_p50_ms"] = peer["meta_p50_ms"] if peer else None

    mb = payload_bytes(batch) / 2**20
    print(f"workload: {args.n} trajectories x {args.tokens} tokens ({mb:.1f} MiB), chunks of {args.chunk}")
    rows = [
        ("ours ipc (put + get)", res["ipc_gbps"], "GB/s"), ("ours tcp (put + get)", res["tcp_gbps"], "GB/s"),
        ("raw pyzmq ipc relay", res["raw_ipc_gbps"], "GB/s"), ("raw pyzmq tcp relay", res["raw_tcp_gbps"], "GB/s"),
        ("ratio ipc / raw ipc", res["ratio"], "x"), ("get_meta p50 (1,024)", res["get_meta_p50_ms"], "ms"),
        ("get_meta p99 (1,024)", res["get_meta_p99_ms"], "ms"),
        (f"controller RSS ({args.rss_samples:,} samples)", res["controller_rss_mb_1m"], "MB"),
        ("transferqueue (put + get)", res["transferqueue_gbps"], "GB/s"),
        ("ours / transferqueue", res["vs_transferqueue"], "x"),
        ("transferqueue meta p50", res["transferqueue_meta_p50_ms"], "ms"),
    ]
    for name, value, unit in rows:
        print(f"{name:<34} {'n/a' if value is None else f'{value:10.3f}'} {unit}")
    if why:
        print(f"peer: {why}")
    if args.json:
        print(json.dumps({k: (None if v is None else round(v, 4)) for k, v in res.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
