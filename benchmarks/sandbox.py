"""``psrl bench sandbox``: sandbox start + exec + close latency per backend against plain ``sh``,
warm-pool acquire latency, and leaks after many pool cycles with random cancellations.

The arms (sh, bubblewrap, Docker when an engine runs) are interleaved: ``--rounds`` rounds, each
running every arm's share of cycles, in ABBA order (forward, then reversed), so a change of
machine load hits every arm alike. Per arm: median and p90 over all cycles, and the best and
median of the per-round medians.

Goals (issue 4): bubblewrap median under 10 ms, warm acquire under 1 ms, 0 leaks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import tempfile
import time

import anyio

from psrl.config.sandbox import SandboxPoolConfig, SandboxSpec
from psrl.sandboxes import SandboxPool, make_backend
from psrl.sandboxes._state import processes_of


def _ms(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return statistics.median(s) * 1e3, s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))] * 1e3


def docker_engine() -> str | None:
    """The DOCKER_HOST of an engine that answers, or None."""
    host = os.environ.get("DOCKER_HOST", "")
    if not host.startswith("unix://"):
        return None
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(2)
            s.connect(host[len("unix://"):])
            s.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
            return host if b" 200 " in s.recv(64) else None
    except OSError:
        return None


async def _sh_cycle() -> None:
    await anyio.run_process(["sh", "-c", "true"])


async def _timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t)
    return out


class _Cycles:
    """One arm: start a sandbox of ``spec``, run ``true``, close it (its backend stays open)."""

    def __init__(self, spec: SandboxSpec) -> None:
        self.backend = make_backend(spec)

    async def __call__(self) -> None:
        sb = await self.backend.create()
        try:
            r = await sb.exec("true")
            assert r.exit_code == 0, r
        finally:
            await sb.aclose()


async def interleaved(arms: dict, per_round: dict[str, int], rounds: int) -> dict[str, list[list[float]]]:
    """Seconds per cycle of each arm, per round; the arms' order alternates (ABBA)."""
    names = list(arms)
    for name in names:
        await arms[name]()  # warm caches (page cache, image layers) before anything is timed
    out: dict[str, list[list[float]]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            out[name].append(await _timed(arms[name], per_round[name]))
    return out


def _summary(res: dict, name: str, per_round: list[list[float]]) -> None:
    res[f"{name}_median_ms"], res[f"{name}_p90_ms"] = _ms([x for r in per_round for x in r])
    medians = [statistics.median(r) * 1e3 for r in per_round if r]
    res[f"{name}_best_round_median_ms"] = min(medians)
    res[f"{name}_median_round_median_ms"] = statistics.median(medians)


async def _warm_acquire(spec: SandboxSpec, n: int) -> list[float]:
    samples = []
    async with SandboxPool(spec, SandboxPoolConfig(warm=2)) as pool:
        for _ in range(n):
            t = time.perf_counter()
            async with pool.acquire() as sb:
                samples.append(time.perf_counter() - t)
                del sb
    return samples


class _Recording:
    """Wraps a backend and notes the uid of every sandbox it makes, so that the leak count covers
    exactly this run's sandboxes, not another run's on the same machine."""

    def __init__(self, backend, uids: set[int]) -> None:
        self._backend, self._uids = backend, uids

    async def create(self):
        sb = await self._backend.create()
        if isinstance(getattr(sb, "uid", None), int):
            self._uids.add(sb.uid)
        return sb

    async def reap_stale(self):
        return await self._backend.reap_stale()

    async def aclose(self) -> None:
        await self._backend.aclose()


async def _churn(spec: SandboxSpec, cycles: int, cancel_frac: float, seed: int, uids: set[int]) -> int:
    """``cycles`` acquire + exec rounds, 8 at a time; a random ``cancel_frac`` of them cancelled at
    a random moment. Returns how many were cancelled."""
    rng = random.Random(seed)
    cancelled = 0
    limiter = anyio.CapacityLimiter(8)
    cfg = SandboxPoolConfig(warm=4, max_concurrency=8, max_creates_per_s=1000)
    backend = _Recording(make_backend(spec), uids)
    try:
        async with SandboxPool(spec, cfg, backend=backend) as pool:

            async def one(cancel_after: float | None) -> None:
                nonlocal cancelled
                async with limiter:
                    with anyio.CancelScope() as scope:
                        if cancel_after is not None:
                            scope.deadline = anyio.current_time() + cancel_after
                        async with pool.acquire() as sb:
                            await sb.exec("echo x > f; sleep 0.02 & sleep 0.01; cat f")
                    cancelled += scope.cancelled_caught

            async with anyio.create_task_group() as tg:
                for _ in range(cycles):
                    tg.start_soon(one, rng.uniform(0, 0.03) if rng.random() < cancel_frac else None)
    finally:
        await backend.aclose()
    return cancelled


def _sandbox_processes(state_dir: str, uids: set[int]) -> int:
    """Host processes of this run's sandboxes: bwrap itself (its argv names the state dir) and,
    as root, whatever ran under one of the sandbox uids (as another user, nothing outlives bwrap)."""
    own_uid = os.getuid()
    return len(processes_of(uids=uids - {own_uid}, path_marks=(state_dir.encode() + b"/",)))


def _mounts_mentioning(path: str) -> int:
    with open("/proc/self/mountinfo") as f:
        return sum(path in line for line in f)


async def _docker_leftovers(spec: SandboxSpec) -> int:
    """psrl containers and volumes this process still owns on the engine."""
    from psrl.sandboxes.docker import LABEL, OWNER_LABEL, owner_id

    backend = make_backend(spec)
    try:
        async def count() -> int:
            docker = backend._client()
            mine = json.dumps({"label": [f"{LABEL}=1", f"{OWNER_LABEL}={owner_id()}"]})
            containers = await docker.containers.list(all=True, filters=mine)
            volumes = await docker.volumes.list(filters={"label": [f"{LABEL}=1", f"{OWNER_LABEL}={owner_id()}"]})
            return len(containers) + len(volumes.get("Volumes") or [])

        return await backend.aio.call(count)
    finally:
        await backend.aclose()


async def run(args: argparse.Namespace) -> dict:
    state_dir = tempfile.mkdtemp(prefix="psrl-bench-sandbox-")
    bw = SandboxSpec(backend="bubblewrap", state_dir=state_dir)
    res: dict = {"rounds": args.rounds, "load_1min_before": round(os.getloadavg()[0], 2)}
    engine = docker_engine()
    dk = SandboxSpec(backend="docker", docker_host=engine) if engine else None
    arms: dict = {"sh": _sh_cycle, "bubblewrap": _Cycles(bw)}
    per_round = {"sh": max(1, args.samples // args.rounds), "bubblewrap": max(1, args.samples // args.rounds)}
    if dk is not None:
        arms["docker"], per_round["docker"] = _Cycles(dk), max(1, args.docker_samples // args.rounds)
    try:
        timings = await interleaved(arms, per_round, args.rounds)
    finally:
        for arm in arms.values():
            if isinstance(arm, _Cycles):
                await arm.backend.aclose()
    res["docker_median_ms"] = res["docker_p90_ms"] = None
    for name, per in timings.items():
        _summary(res, name, per)
    res["load_1min_after"] = round(os.getloadavg()[0], 2)
    res["warm_acquire_ms"], res["warm_acquire_p90_ms"] = _ms(await _warm_acquire(bw, args.samples))

    mounts_before = _mounts_mentioning(state_dir)
    t = time.perf_counter()
    uids: set[int] = set()
    cancelled = await _churn(bw, args.cycles, args.cancel_frac, args.seed, uids)
    docker_cancelled = 0
    if dk is not None and args.docker_cycles:
        docker_cancelled = await _churn(dk, args.docker_cycles, args.cancel_frac, args.seed, set())
    res["churn_s"] = time.perf_counter() - t
    detail = {
        "processes": _sandbox_processes(state_dir, uids),
        "mounts": _mounts_mentioning(state_dir) - mounts_before,
        "temp_dirs": len(os.listdir(state_dir)),
        "containers": await _docker_leftovers(dk) if dk is not None else 0,
    }
    os.rmdir(state_dir) if not os.listdir(state_dir) else None
    res.update(
        cycles=args.cycles, cancelled=cancelled,
        docker_cycles=args.docker_cycles if dk else 0, docker_cancelled=docker_cancelled,
        bubblewrap_vs_sh=res["bubblewrap_median_ms"] / res["sh_median_ms"],
        docker_vs_sh=(res["docker_median_ms"] / res["sh_median_ms"]) if dk else None,
        leak_detail=detail, leaks=sum(detail.values()),
    )
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="psrl bench sandbox", description=__doc__)
    p.add_argument("--samples", type=int, default=50, help="start+exec+close cycles per arm (sh, bubblewrap), over all rounds")
    p.add_argument("--docker-samples", type=int, default=10, help="Docker cycles, over all rounds")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (>= 3), ABBA order")
    p.add_argument("--cycles", type=int, default=500, help="pool cycles for the leak check")
    p.add_argument("--docker-cycles", type=int, default=40, help="docker pool cycles for the leak check")
    p.add_argument("--cancel-frac", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    args = p.parse_args(argv)
    if args.rounds < 3:
        p.error("--rounds must be >= 3")
    res = anyio.run(run, args)

    def f(v: float | None) -> str:
        return f"{'n/a':>9}" if v is None else f"{v:9.2f}"

    print(f"{res['rounds']} interleaved rounds (ABBA); load (1 min) {res['load_1min_before']} before, {res['load_1min_after']} after")
    print(f"{'start+exec+close':<22}{'median ms':>10}{'p90 ms':>10}{'x sh':>8}   round medians: best / median")
    rounds = {k: f"   {res[k + '_best_round_median_ms']:.2f} / {res[k + '_median_round_median_ms']:.2f}"
              for k in ("sh", "bubblewrap", "docker") if f"{k}_best_round_median_ms" in res}
    print(f"{'sh (baseline)':<22}{f(res['sh_median_ms'])}{f(res['sh_p90_ms'])}{1.0:8.1f}{rounds['sh']}")
    print(f"{'bubblewrap':<22}{f(res['bubblewrap_median_ms'])}{f(res['bubblewrap_p90_ms'])}{res['bubblewrap_vs_sh']:8.1f}{rounds['bubblewrap']}")
    docker_ratio = "n/a" if res["docker_vs_sh"] is None else f"{res['docker_vs_sh']:8.1f}"
    print(f"{'docker':<22}{f(res['docker_median_ms'])}{f(res['docker_p90_ms'])}{docker_ratio:>8}{rounds.get('docker', '')}")
    print(f"{'warm pool acquire':<22}{f(res['warm_acquire_ms'])}{f(res['warm_acquire_p90_ms'])}")
    print(f"leaks after {res['cycles']} bubblewrap cycles ({res['cancelled']} cancelled) and "
          f"{res['docker_cycles']} docker cycles ({res['docker_cancelled']} cancelled): "
          + ", ".join(f"{k} {v}" for k, v in res["leak_detail"].items()) + f"  (total {res['leaks']})")
    if args.json:
        print(json.dumps(res))
    return 0 if res["leaks"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
