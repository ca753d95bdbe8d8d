"""``psrl bench queue``: TransferQueue throughput and latency against raw ZeroMQ and the peer.

Workload: 1,000 trajectories x 2,048 tokens (response ids int32, log-probs float32, loss mask
int8, versions int32: 26.6 MB) and the scalar ``min_version`` that production's ``to_arrow``
derives (int32), put in chunks of ``--chunk`` trajectories, then fetched back.

- ``ipc_gbps`` / ``tcp_gbps``: payload bytes / (time to put every chunk + time to take and
  fetch them all), ``--concurrency`` producers then as many consumers at once. The benchmark
  process is producer and consumer; the queue runs in its own process with one storage unit (the
  default: the controller's process holds it, and a put and a ``get_batch`` are one round trip
  each), so every byte crosses two process boundaries (producer -> queue -> consumer).
- ``raw_*_gbps``: the same bytes in the same chunks over raw pyzmq zero-copy PUSH/PULL through a
  store-and-forward relay process: the same two crossings with nothing else.
  ``ratio`` = ipc / raw ipc, ``tcp_ratio`` = tcp / raw tcp.
- ``transferqueue_tcp_gbps``: the peer (PyPI ``transferqueue``, on Ray; it binds tcp only) on the
  same workload with the same concurrency through its async API; ``vs_transferqueue`` = our tcp
  / its tcp. Its venv is built on first use (``benchmarks/setup_peer_venv.sh`` into
  ``~/.cache/psrl/peer-venv``; ``--peer-python`` or ``PSRL_PEER_PYTHON`` to use another).
- Arms of a transport run interleaved in alternating order (A B C, C B A, ...) after one warm-up
  round each; every figure is given as best and median of ``--rounds`` rounds; headline ratios
  divide best rounds (``*_median`` keys divide medians).
- ``*_cpu_ms_per_round``: CPU time (user + system, every thread) the benchmark process and the
  arm's other process (our queue service, the raw relay) spent per round, mean over the rounds.
  On a machine with few cores a round cannot be shorter than this CPU time over the cores: the
  figure says how much of a ratio below 1 is our Python per message (raw ZeroMQ's CPU is almost
  all kernel copies, which ours pays too).
- ``get_meta_p50_ms`` / ``p99``: ``get_meta`` of 1,024-sample batches with ``--meta-batches`` x
  1,024 samples held at the start, ours and the peer's alternating in blocks.
- ``controller_rss_mb_1m``: resident memory of the controller holding 1,000,000 samples' metadata
  (two storage units, so that the controller's process holds no unit).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import numpy as np
import psutil

from psrl.config import TransferQueueConfig
from psrl.transfer_queue import start_transfer_queue

from benchmarks.queue_arms import OursArm, PeerArm, RawArm, make_workload, payload_bytes

DEFAULT_PEER_VENV = Path.home() / ".cache" / "psrl" / "peer-venv"
META_BLOCKS = 4


async def _interleaved(
    arms: dict[str, object], rounds: int, failed: dict[str, str], cpu: dict[str, list[float]]
) -> dict[str, list[float]]:
    """Seconds per round per arm: one warm-up round each, then ``rounds`` in ABBA order. The
    peer arm is dropped (its reason in ``failed``) if a round of it fails or hangs. ``cpu``
    gets the CPU seconds of each timed round of the arms that measure it (ours, the relay)."""

    async def one(name: str) -> None:
        arm = arms[name]
        try:
            seconds = await arm.round() if isinstance(arm, OursArm) else await anyio.to_thread.run_sync(arm.round)
        except RuntimeError as e:
            if name != "peer":
                raise
            failed[name] = str(e)
            return
        out[name].append(seconds)

    names = list(arms)
    out: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        await one(name)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            if name not in failed:
                await one(name)
    out = {name: secs[1:] for name, secs in out.items() if name not in failed}  # warm-up rounds out
    for name in out:
        if hasattr(arms[name], "cpu"):
            cpu[name] = arms[name].cpu[1:]
    return out


async def _throughput(
    transport: str, batch, args, peer: PeerArm | None, failed: dict[str, str], cpu: dict[str, list[float]]
) -> dict[str, list[float]]:
    async with AsyncExitStack() as stack:
        ours = OursArm(transport, batch, args.chunk, args.concurrency)
        await ours.open(stack)
        raw = RawArm(transport, batch, args.chunk)
        stack.callback(raw.close)
        arms: dict[str, object] = {"ours": ours, "raw": raw}
        if peer is not None:
            arms["peer"] = peer
        return await _interleaved(arms, args.rounds, failed, cpu)


async def _get_meta_latency(batches: int, peer: PeerArm | None, failed: dict[str, str]) -> tuple[list[float], list[float]]:
    """Both hold ``batches`` x 1,024 samples, then time ``batches`` get_meta calls each, in
    ``META_BLOCKS`` blocks alternating which goes first (the peer is left out if it fails)."""
    cfg = TransferQueueConfig(transport="tcp", storage_units=1, capacity_samples=2_000_000, request_timeout_s=120)
    ours_ms: list[float] = []
    peer_ms: list[float] = []
    async with start_transfer_queue(cfg) as handle, handle.connect() as q:
        for b in range(batches):
            keys = [f"m{b}-{i}" for i in range(1024)]
            await q.batch_put({"key": keys, "group_id": [f"g{b}-{i // 8}" for i in range(1024)], "reward": np.zeros(1024)})
        async def ask(command: str) -> dict | None:
            if peer is None or "peer_meta" in failed:
                return None
            try:
                return await anyio.to_thread.run_sync(peer.ask, command)
            except RuntimeError as e:
                failed["peer_meta"] = str(e)
                return None

        await ask("meta_fill")

        async def ours_block(k: int) -> None:
            for _ in range(k):
                t0 = anyio.current_time()
                meta = await q.get_meta("train", 1024, ["reward"], consumer="bench")
                ours_ms.append((anyio.current_time() - t0) * 1e3)
                assert len(meta) == 1024

        async def peer_block(k: int) -> None:
            answer = await ask(f"meta {k}")
            if answer is not None:
                peer_ms.extend(answer["ms"])

        sizes = [len(s) for s in np.array_split(np.arange(batches), META_BLOCKS)]
        for i, k in enumerate(sizes):
            for block in (ours_block, peer_block) if i % 2 == 0 else (peer_block, ours_block):
                await block(k)
    return ours_ms, peer_ms


async def _controller_rss(samples: int, per_put: int = 20_000) -> float:
    # Two units: with one, the controller's process would also hold the unit's data and index.
    cfg = TransferQueueConfig(transport="ipc", storage_units=2, capacity_samples=samples, request_timeout_s=120)
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


def _peer_python(args: argparse.Namespace) -> tuple[str | None, str]:
    """The peer venv's python, built on first use (pip from the package index)."""
    if args.peer_python:
        return (args.peer_python, "") if Path(args.peer_python).exists() else (None, f"no python at {args.peer_python}")
    python = DEFAULT_PEER_VENV / "bin" / "python"
    if (DEFAULT_PEER_VENV / ".psrl-ready").exists():
        return str(python), ""
    print(f"building the peer venv in {DEFAULT_PEER_VENV} (first use; ~1 min)", file=sys.stderr)
    setup = Path(__file__).with_name("setup_peer_venv.sh")
    try:
        out = subprocess.run(["bash", str(setup), str(DEFAULT_PEER_VENV)], capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        return None, "building the peer venv timed out"
    if out.returncode or not python.exists():
        return None, f"building the peer venv failed (rc {out.returncode}): {(out.stderr or out.stdout)[-800:]}"
    return str(python), ""


def _stats(nbytes: int, seconds: list[float]) -> tuple[float, float]:
    gbps = [nbytes / s / 1e9 for s in seconds]
    return max(gbps), float(np.median(gbps))


async def _run(args: argparse.Namespace) -> tuple[dict, str]:
    batch = make_workload(args.n, args.tokens)
    nbytes = payload_bytes(batch)
    res: dict = {"loadavg_start": list(os.getloadavg())}
    peer, why = None, "skipped (--no-peer)"
    async with AsyncExitStack() as stack:
        if not args.no_peer:
            python, why = await anyio.to_thread.run_sync(_peer_python, args)
            if python:
                try:
                    peer = await anyio.to_thread.run_sync(lambda: PeerArm(
                        python, n=args.n, tokens=args.tokens, chunk=args.chunk, concurrency=args.concurrency,
                        meta_batches=args.meta_batches, units=args.peer_units,
                    ))
                    stack.callback(peer.close)
                    why = f"transferqueue on Ray, {peer.info['units']} storage units, tcp (the peer has no ipc)"
                except (RuntimeError, OSError) as e:
                    why = f"the peer did not start: {e}"
        failed: dict[str, str] = {}
        for transport in ("ipc", "tcp"):
            cpu: dict[str, list[float]] = {}
            secs = await _throughput(transport, batch, args, peer if transport == "tcp" else None, failed, cpu)
            if "peer" in failed:
                why, peer = f"the peer failed: {failed['peer']}", None
            for arm, key in (("ours", transport), ("raw", f"raw_{transport}"), ("peer", f"transferqueue_{transport}")):
                if arm in secs:
                    res[f"{key}_gbps"], res[f"{key}_gbps_median"] = _stats(nbytes, secs[arm])
                if arm in cpu:
                    res[f"{key}_cpu_ms_per_round"] = float(np.mean(cpu[arm])) * 1e3
        res.setdefault("transferqueue_tcp_gbps", None)
        res.setdefault("transferqueue_tcp_gbps_median", None)
        res["transferqueue_ipc_gbps"] = None  # the peer binds tcp only
        for key, num, den in (("ratio", "ipc", "raw_ipc"), ("tcp_ratio", "tcp", "raw_tcp"),
                              ("vs_transferqueue", "tcp", "transferqueue_tcp")):
            have = res.get(f"{den}_gbps") is not None
            res[key] = res[f"{num}_gbps"] / res[f"{den}_gbps"] if have else None
            res[f"{key}_median"] = res[f"{num}_gbps_median"] / res[f"{den}_gbps_median"] if have else None
        ours_ms, peer_ms = await _get_meta_latency(args.meta_batches, peer, failed)
        if "peer_meta" in failed:
            why += f"; its get_meta failed: {failed['peer_meta']}"
            peer_ms = []
    res["get_meta_held_samples"] = args.meta_batches * 1024
    res["get_meta_p50_ms"], res["get_meta_p99_ms"] = np.percentile(ours_ms, [50, 99]).tolist()
    res["transferqueue_meta_p50_ms"], res["transferqueue_meta_p99_ms"] = (
        np.percentile(peer_ms, [50, 99]).tolist() if peer_ms else (None, None)
    )
    res["controller_rss_mb_1m"] = await _controller_rss(args.rss_samples)
    res["loadavg_end"] = list(os.getloadavg())
    return res, why


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="psrl bench queue", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1000, help="trajectories")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per trajectory")
    ap.add_argument("--chunk", type=int, default=100, help="trajectories per put / per get")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per arm (>= 3; best and median reported)")
    ap.add_argument("--concurrency", type=int, default=4, help="concurrent producers, then consumers (every arm)")
    ap.add_argument("--meta-batches", type=int, default=100, help="1,024-sample get_meta calls timed (x 1,024 held)")
    ap.add_argument("--rss-samples", type=int, default=1_000_000)
    ap.add_argument("--peer-python", default=os.environ.get("PSRL_PEER_PYTHON"),
                    help=f"python of a venv with transferqueue (default: {DEFAULT_PEER_VENV}, built on first use)")
    ap.add_argument("--peer-units", type=int, default=2, help="the peer's storage units (its documented default)")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.rounds < 3:
        ap.error("--rounds must be >= 3 (best and median of at least 3 rounds)")

    res, why = anyio.run(_run, args)
    mb = payload_bytes(make_workload(1, args.tokens)) * args.n / 2**20
    print(f"workload: {args.n} trajectories x {args.tokens} tokens ({mb:.1f} MiB), chunks of {args.chunk}, "
          f"{args.concurrency} producers / consumers, {args.rounds} rounds per arm after 1 warm-up, ABBA order")
    print(f"load average (1, 5, 15 min): start {_fmt(res['loadavg_start'])}, end {_fmt(res['loadavg_end'])}")
    rows = [(f"{label} (put + get)", key, "GB/s") for label, key in (
        ("ours ipc", "ipc"), ("raw pyzmq ipc relay", "raw_ipc"), ("ours tcp", "tcp"), ("raw pyzmq tcp relay", "raw_tcp"),
        ("transferqueue tcp", "transferqueue_tcp"))]
    print(f"{'':<36} {'best':>9} {'median':>9}")
    for name, key, unit in rows:
        print(f"{name:<36} {_num(res.get(f'{key}_gbps'))} {_num(res.get(f'{key}_gbps_median'))} {unit}")
    for name, key in (("ratio ipc / raw ipc", "ratio"), ("tcp_ratio tcp / raw tcp", "tcp_ratio"),
                      ("vs_transferqueue tcp / tcp", "vs_transferqueue")):
        print(f"{name:<36} {_num(res[key])} {_num(res[f'{key}_median'])} x")
    print(f"CPU per round, all threads of both processes ({os.cpu_count()} cores): "
          + ", ".join(f"{name} {res[f'{key}_cpu_ms_per_round']:.1f} ms" for name, key in (
              ("ours ipc", "ipc"), ("raw ipc", "raw_ipc"), ("ours tcp", "tcp"), ("raw tcp", "raw_tcp"))))
    held = f"{res['get_meta_held_samples']:,} held"
    print(f"{'get_meta p50 / p99 (1,024), ' + held:<36} {_num(res['get_meta_p50_ms'])} {_num(res['get_meta_p99_ms'])} ms")
    print(f"{'transferqueue get_meta p50 / p99':<36} {_num(res['transferqueue_meta_p50_ms'])} "
          f"{_num(res['transferqueue_meta_p99_ms'])} ms")
    print(f"{f'controller RSS ({args.rss_samples:,} samples)':<36} {_num(res['controller_rss_mb_1m'])} MB")
    print(f"peer: {why}")
    if args.json:
        print(json.dumps({k: _round(v) for k, v in res.items()}))
    return 0


def _num(v: float | None) -> str:
    return f"{'n/a':>9}" if v is None else f"{v:9.3f}"


def _fmt(load: list[float]) -> str:
    return " ".join(f"{x:.2f}" for x in load)


def _round(v):
    if isinstance(v, list):
        return [round(x, 2) for x in v]
    return None if v is None else round(v, 4)


if __name__ == "__main__":
    sys.exit(main())
