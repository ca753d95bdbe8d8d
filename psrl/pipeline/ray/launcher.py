"""``psrl train ... launcher=ray``: the same run as ``launcher=local``, with its parts on Ray.

Where each part runs:

- engine replicas: one Ray actor each (``ray.engine`` resources), a ``VLLMEngine`` inside, driven
  through the driver's ``Router`` (``engine``);
- trainer ranks: ``tensor x pipeline x data`` actors (``ray.trainer`` resources) behind a
  ``PolicyTrainer`` proxy (``trainer``); each data-parallel rank fetches its own share of a
  step (whole groups) from the queue by ``KVBatchMeta``, so the driver receives scalars only;
  after each step the weight-source ranks stream the weights straight into the engine actors'
  workers (``weight_sync``), never through the driver;
- transfer queue: the controller and each storage unit are actors (``ray.queue`` resources)
  serving ZeroMQ over tcp, CURVE-authenticated with ``transfer_queue.curve_auth`` (``queue_actors``);
- rollout workers (agent loops, environments, their sandboxes, gateways): the driver with
  ``ray.rollout_workers=0``; otherwise that many actors (``ray.rollout_worker`` resources, e.g. a
  custom resource of environment nodes), each writing its groups into the queue itself
  (``worker_pool``);
- the scheduler: the driver, exactly the local one; with worker actors it deals in task ids,
  admission and group reports only.

``ray.address``: "local" starts a private cluster for the run; "auto" or "host:port" joins a
running one. Every actor this run started is killed when it ends, however it ends.
"""

from __future__ import annotations

import sys
from contextlib import AsyncExitStack
from typing import Any

import anyio

from psrl.config import PSRLConfig
from psrl.log import get_logger

from psrl.transfer_queue.rpc import first_error

from .common import RayLaunchError, ray_cluster
from ..scheduler import ScheduleConfig
from ..train import RunParts, TrainingSetupError, run_pipeline

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
    return await run_pipeline(cfg, _open_ray_parts, on_ready=on_ready)


async def _open_ray_parts(cfg: PSRLConfig, sched_cfg: ScheduleConfig, stack: AsyncExitStack) -> RunParts:
    from .engine import open_ray_engine
    from .queue_actors import start_ray_transfer_queue
    from .trainer import RayPolicyTrainer
    from ..tq_queue import queue_config

    gen = cfg.gen_actor_rollout_ref
    if cfg.trainer.lora.rank and not cfg.trainer.lora.merge_for_rollout:
        raise TrainingSetupError("trainer.lora with launcher=ray: the Ray engines do not serve adapters yet; "
                                 "set trainer.lora.merge_for_rollout=true (full merged weights are synced)")
    temperature = gen.rollout.sampling.temperature or 1.0  # log-probs of greedy sampling: T=1
    policy_model = cfg.trainer.model_path or gen.model.path  # each rank resolves it on its own node
    started: list[RayPolicyTrainer] = []  # filled in the thread, so a cancelled start still closes it

    async def close_started() -> None:
        for policy in started:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(policy.close)

    stack.push_async_callback(close_started)
    # The trainer ranks start in a thread while the queue and the engines start here.
    with first_error():
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, lambda: started.append(RayPolicyTrainer.create(
                policy_model, cfg.trainer, cfg.algorithm, cfg.ray, temperature=temperature, weight_sync=cfg.weight_sync,
                critic=cfg.critic,
            )))
            handle = await stack.enter_async_context(start_ray_transfer_queue(
                queue_config(cfg.transfer_queue, eta=sched_cfg.eta, samples_per_step=sched_cfg.samples_per_step), cfg.ray
            ))
            engine = await stack.enter_async_context(open_ray_engine(gen.rollout, gen.model, cfg.ray, version=0))
    (policy,) = started
    policy.attach_queue(handle)  # trainer ranks fetch their own shares: the driver sees metadata only
    rollout = None
    if cfg.ray.rollout_workers:
        from .worker_pool import open_rollout_workers

        rollout = await open_rollout_workers(cfg, sched_cfg, handle, engine, stack)
    return RunParts(policy, engine, handle, rollout)
