"""``psrl train ... launcher=ray``: the same run as ``launcher=local``, with its parts on Ray.

Where each part runs:

- engine replicas: one Ray actor each (``ray.engine`` resources), a ``VLLMEngine`` inside, driven
  through the driver's ``Router`` (``ray_engine``);
- trainer ranks: ``tensor x pipeline x data`` actors (``ray.trainer`` resources) behind a
  ``PolicyTrainer`` proxy (``ray_trainer``);
- transfer queue: the controller and each storage unit are actors (``ray.queue`` resources)
  serving ZeroMQ over tcp, CURVE-authenticated with ``transfer_queue.curve_auth`` (``ray_queue``);
- rollout workers (agent loops, environments, their sandboxes) and the scheduler: the driver, so
  sandboxes live where the driver runs and the scheduler is exactly the local one.

``ray.address``: "local" starts a private cluster for the run; "auto" or "host:port" joins a
running one. Every actor this run started is killed when it ends, however it ends.
"""

from __future__ import annotations

import sys
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio

from psrl.config import PSRLConfig
from psrl.log import get_logger

from . import checkpoint
from psrl.transfer_queue.rpc import first_error

from .metrics import FailureRateExceeded, first_leaf
from .ray_common import RayLaunchError, ray_cluster
from .report import plot_rewards
from .scheduler import Scheduler
from .tasks import TaskSource
from .train import TrainingSetupError, _load_data, _watch_signals, _writers, schedule_config

log = get_logger("psrl.train")


def run_training_ray(cfg: PSRLConfig) -> int:
    """``run_training`` for ``launcher=ray``; the same exit codes (2 also when the cluster cannot
    be joined or a component cannot be placed)."""
    try:
        with ray_cluster(cfg.ray):
            return anyio.run(train_on_ray, cfg, backend="asyncio")  # vLLM's AsyncLLM needs asyncio
    except (TrainingSetupError, RayLaunchError) as e:
        print(f"psrl: error: {e}", file=sys.stderr)
        return 2


async def train_on_ray(cfg: PSRLConfig, *, on_ready: Any = None) -> int:
    """The whole run, driven from this event loop, on the cluster this process joined
    (``ray_cluster``). ``on_ready(scheduler)`` is called once every part is up."""
    from transformers import AutoTokenizer

    from psrl.agent_loops.runner import RolloutRunner
    from psrl.models import resolve_model_path
    from psrl.sandboxes.pool import SandboxPool

    from .ray_engine import open_ray_engine
    from .ray_queue import start_ray_transfer_queue
    from .ray_trainer import RayPolicyTrainer
    from .tq_queue import TransferQueueGroups, queue_config

    sched_cfg = schedule_config(cfg)
    gen, val = cfg.gen_actor_rollout_ref, cfg.train_actor_rollout_ref
    rows, val_rows = _load_data(cfg)
    ckpt_root = Path(cfg.trainer.checkpoint_dir).absolute()
    resume_from = checkpoint.latest(ckpt_root) if cfg.trainer.resume else None
    if cfg.trainer.resume and resume_from is None:
        raise TrainingSetupError(f"trainer.resume=true but {ckpt_root} holds no checkpoint")
    policy_model = cfg.trainer.model_path or gen.model.path  # each rank resolves it on its own node
    try:
        model_dir = await anyio.to_thread.run_sync(resolve_model_path, policy_model)
    except FileNotFoundError as e:
        raise TrainingSetupError(str(e)) from None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    temperature = gen.rollout.sampling.temperature or 1.0  # log-probs of greedy sampling: T=1
    samples_per_step = sched_cfg.groups_per_step * sched_cfg.group_size
    flag = {"interrupted": False}
    code = 0
    sink = None
    started: list[RayPolicyTrainer] = []  # filled in the thread, so a cancelled start still closes it
    try:
        async with AsyncExitStack() as stack:
            # The trainer ranks start in a thread while the queue and the engines start here.
            with first_error():
                async with anyio.create_task_group() as tg:
                    tg.start_soon(anyio.to_thread.run_sync, lambda: started.append(RayPolicyTrainer.create(
                        policy_model, cfg.trainer, cfg.algorithm, cfg.ray, temperature=temperature
                    )))
                    handle = await stack.enter_async_context(start_ray_transfer_queue(
                        queue_config(cfg.transfer_queue, eta=sched_cfg.eta, samples_per_step=samples_per_step), cfg.ray
                    ))
                    engine = await stack.enter_async_context(open_ray_engine(gen.rollout, gen.model, cfg.ray, version=0))
            (policy,) = started
            state = await anyio.to_thread.run_sync(checkpoint.load, resume_from, policy) if resume_from is not None else None
            start = int(state["version"]) if state else 0
            if state:
                log.info("resuming", checkpoint=str(resume_from), step=start)
            sink = _writers(cfg, start)
            pool = await stack.enter_async_context(SandboxPool(cfg.sandbox.spec, cfg.sandbox.pool))
            client = await stack.enter_async_context(handle.connect())
            runner = RolloutRunner(
                gen.rollout, tokenizer=tokenizer, sandbox_pool=pool, max_prompt_length=cfg.data.max_prompt_length,
                validation_rollout=val.rollout,
            )
            sched = Scheduler(
                sched_cfg, engine=engine, rollout=runner, trainer=policy,
                queue=TransferQueueGroups(client, samples_per_step=samples_per_step),
                tasks=TaskSource(rows, shuffle=cfg.data.shuffle, seed=cfg.data.seed), val_rows=val_rows, sink=sink,
                on_checkpoint=lambda s: checkpoint.save(ckpt_root, s.state_dict(), s.trainer),
            )
            if state:
                sched.load_state_dict(state)
            if on_ready is not None:
                on_ready(sched)
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_watch_signals, tg.cancel_scope, sched, flag)
                    await sched.run()
                    tg.cancel_scope.cancel()
            except* FailureRateExceeded as eg:
                reason = str(first_leaf(eg))
                log.error("stopping: too many failed episodes", reason=reason)
                print(f"psrl: training stopped: {reason}", file=sys.stderr)
                code = 1
            with anyio.CancelScope(shield=True):
                path = await anyio.to_thread.run_sync(checkpoint.save, ckpt_root, sched.state_dict(), policy)
                log.info("checkpoint saved", path=str(path), step=sched.version)
    finally:
        if sink is not None:
            sink.close()
        for policy in started:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(policy.close)
    jsonl = Path(cfg.logging.output_dir) / "metrics.jsonl"
    if cfg.logging.jsonl and jsonl.is_file():
        png = plot_rewards(jsonl, Path(cfg.logging.output_dir) / "reward.png")
        log.info("reward plot written", path=str(png))
    return 130 if flag["interrupted"] else code
