"""``psrl bench pipeline``: sync versus one-step-off versus async, in one run.

SIMULATED by default: the engine, environments and trainer follow the stated latency model in
``psrl.testing.latency_model`` (heavy-tailed response lengths, random env latency), while the
scheduler, admission control, staleness bound and queue are the ones ``psrl train`` runs. Every
figure is labelled simulated. Samples/s are in simulated seconds, measured over the steps after
``--warmup``; ``efficiency`` is a mode's throughput over the bound the latency model allows for
it (sync: slowest episode of the batch + train + sync per step; overlapped modes: the slower of
trainer and engine, for the batches actually trained on); the JSON ``efficiency`` is async eta=4.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import anyio

from psrl.pipeline.local_queue import LocalGroupQueue
from psrl.pipeline.metrics import staleness_histogram
from psrl.pipeline.scheduler import ScheduleConfig, Scheduler
from psrl.pipeline.tasks import TaskSource
from psrl.testing.latency_model import LatencyModel
from psrl.testing.sim_engine import SimulatedEngine
from psrl.testing.sim_rollout import SimulatedRollout
from psrl.testing.sim_trainer import SimulatedTrainer

MODES: list[tuple[str, str, int]] = [
    ("sync", "sync", 0),
    ("one_step_off", "one_step_off", 1),
    ("async_eta1", "async", 1),
    ("async_eta2", "async", 2),
    ("async_eta4", "async", 4),
]


class _StalenessSink:
    """Collects the per-sample staleness histogram and trained tokens of the steps after warm-up."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.hist: Counter[int] = Counter()
        self.tokens = 0.0

    def log(self, step, metrics, *, kind) -> None:
        if kind == "train" and step > self.warmup:
            self.hist.update(staleness_histogram(metrics))
            self.tokens += metrics["train/tokens"]


async def _run_mode(model: LatencyModel, mode: str, eta: int, args: argparse.Namespace) -> dict:
    cfg = ScheduleConfig(
        mode=mode, eta=eta, groups_per_step=args.groups, group_size=args.n, total_steps=args.steps,
        colocated=False, max_failure_rate=1.0,
    )
    engine = SimulatedEngine(model, seed=args.seed)
    sink = _StalenessSink(args.warmup)
    sched = Scheduler(
        cfg, engine=engine, rollout=SimulatedRollout(model), trainer=SimulatedTrainer(model),
        queue=LocalGroupQueue(eta=eta, samples_per_step=args.groups * args.n), tasks=TaskSource([{"prompt": f"task {i}"} for i in range(1000)], seed=args.seed),
        sink=sink,
    )
    t0 = time.perf_counter()
    try:
        await sched.run()
    finally:
        await engine.aclose()
    wall = time.perf_counter() - t0
    steps = list(sched.history)[args.warmup:]
    sim_s = sum(r.wall_s for r in steps) / model.time_scale
    samples = sum(sink.hist.values())
    bound = model.throughput_bound(
        groups_per_step=args.groups, group_size=args.n, mode=mode, tokens_per_sample=sink.tokens / max(samples, 1)
    )["samples_per_s"]
    rate = samples / sim_s
    return {
        "samples_per_s": rate,
        "bound_samples_per_s": bound,
        "efficiency": rate / bound,
        "staleness": {str(k): v for k, v in sorted(sink.hist.items())},
        "max_staleness": max(sink.hist) if sink.hist else 0,
        "dropped_stale_groups": sched.dropped_stale,
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="psrl bench pipeline", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the throughput figures")
    p.add_argument("--groups", type=int, default=8, help="GRPO groups per trainer step")
    p.add_argument("--n", type=int, default=4, help="episodes per group")
    p.add_argument("--time-scale", type=float, default=0.02, help="real seconds per simulated second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON line last")
    args = p.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        p.error("--warmup must be in [0, --steps)")
    model = LatencyModel(time_scale=args.time_scale)
    results = {name: anyio.run(_run_mode, model, mode, eta, args) for name, mode, eta in MODES}
    base = results["sync"]["samples_per_s"]

    print(f"pipeline benchmark: SIMULATED engine, environments and trainer (psrl.testing.latency_model);")
    print(f"real scheduler and queue. {args.groups} groups x {args.n} episodes per step, {args.steps} steps"
          f" ({args.warmup} warm-up), time scale {args.time_scale}")
    print(f"{'mode':<14}{'samples/s':>11}{'bound':>9}{'effic.':>8}{'speedup':>9}{'dropped':>9}  staleness (age: samples)")
    for name, r in results.items():
        hist = " ".join(f"{k}:{v}" for k, v in r["staleness"].items())
        print(f"{name:<14}{r['samples_per_s']:>11.3f}{r['bound_samples_per_s']:>9.3f}{r['efficiency']:>8.2f}"
              f"{r['samples_per_s'] / base:>8.2f}x{r['dropped_stale_groups']:>9}  {hist}")
    if args.json:
        line = {
            "simulated": True,
            "samples_per_s": {k: round(r["samples_per_s"], 4) for k, r in results.items()},
            "speedup": {k: round(r["samples_per_s"] / base, 3) for k, r in results.items()},
            "speedup_async_eta4": round(results["async_eta4"]["samples_per_s"] / base, 3),
            "efficiency": round(results["async_eta4"]["efficiency"], 3),
            "efficiency_by_mode": {k: round(r["efficiency"], 3) for k, r in results.items()},
            "staleness": {k: r["staleness"] for k, r in results.items()},
            "max_staleness": {k: r["max_staleness"] for k, r in results.items()},
            "latency_model": model.describe(),
        }
        print(json.dumps(line))
    return 0
