"""``psrl train``: build every part from config and run the scheduler.

``run_training(cfg) -> exit code``: 0 when ``total_steps`` were trained, 1 when the failure rate
stopped the run, 2 for a config or resume mistake, 130 after Ctrl-C (SIGINT/SIGTERM). A
checkpoint is written at the end, on Ctrl-C and on a failure stop, beside the ``save_every`` ones;
``trainer.resume=true`` continues from the latest.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from psrl.config import PSRLConfig
from psrl.engines import InferenceEngine
from psrl.log import get_logger

from . import checkpoint
from .metrics import FailureRateExceeded, first_leaf
from .protocols import PolicyTrainer
from .report import JsonlWriter, LogWriter, MetricsFanout, ProgressBar, TensorBoardWriter, WithCounters, plot_rewards
from .scheduler import ScheduleConfig, Scheduler, eta_for
from .tasks import TaskSource

log = get_logger("psrl.train")

# launcher name -> "module:function(cfg) -> int"; ``ray`` is provided by psrl.pipeline.ray.launcher.
LAUNCHERS = {"ray": "psrl.pipeline.ray.launcher:run_training_ray"}


STOP_GRACE_S = 10.0  # after Ctrl-C, how long a weight sync in progress may still take


class TrainingSetupError(ValueError):
    """A mistake found while building the run (exit code 2)."""


def schedule_config(cfg: PSRLConfig) -> ScheduleConfig:
    gen, val = cfg.gen_actor_rollout_ref.rollout, cfg.train_actor_rollout_ref.rollout
    # ``agent.max_concurrency`` bounds the episodes of one runner: the driver's, or each Ray
    # rollout worker's; the scheduler's cap on groups in flight covers all of them.
    runners = cfg.ray.rollout_workers if cfg.launcher == "ray" and cfg.ray.rollout_workers > 0 else 1
    return ScheduleConfig(
        mode=cfg.trainer.mode,
        eta=eta_for(cfg.trainer.mode, cfg.transfer_queue.max_staleness),
        groups_per_step=cfg.data.batch_size,
        group_size=gen.sampling.n,
        total_steps=cfg.trainer.total_steps,
        eval_every=cfg.trainer.eval_every,
        save_every=cfg.trainer.save_every,
        colocated=cfg.trainer.placement == "colocated",
        max_failure_rate=cfg.trainer.max_failure_rate,
        on_stale=cfg.transfer_queue.on_stale,
        on_failure=gen.agent.on_failure,
        max_running_groups=max(1, gen.agent.max_concurrency // gen.sampling.n) * runners,
        val_group_size=val.sampling.n,
        val_concurrency=max(1, val.agent.max_concurrency // val.sampling.n) * runners,
    )


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Child processes started inside inherit SIGINT ignored (it survives exec), so a terminal's
    Ctrl-C reaches only this process, which stops them in order."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_training(cfg: PSRLConfig) -> int:
    if cfg.launcher != "local":
        from psrl.registry import import_path

        try:
            launcher = import_path(LAUNCHERS[cfg.launcher])
        except ImportError as e:
            print(f"psrl: error: launcher={cfg.launcher} is not available: {e}", file=sys.stderr)
            return 2
        return int(launcher(cfg))
    try:
        return anyio.run(train, cfg, backend="asyncio")  # vLLM's AsyncLLM needs asyncio
    except TrainingSetupError as e:
        print(f"psrl: error: {e}", file=sys.stderr)
        return 2


def _load_data(cfg: PSRLConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from psrl.environments.dataset import DatasetError, load_rows

    try:
        rows = load_rows(cfg.data.train_files, max_rows=cfg.data.max_samples)
        val = load_rows(cfg.data.val_files) if cfg.data.val_files else []
    except DatasetError as e:
        raise TrainingSetupError(str(e)) from None
    return rows, val


def _writers(cfg: PSRLConfig, start_step: int) -> MetricsFanout:
    out = Path(cfg.logging.output_dir)
    writers: list[Any] = [LogWriter()]
    if cfg.logging.jsonl:
        writers.append(JsonlWriter(out / "metrics.jsonl"))
    if cfg.logging.tensorboard:
        writers.append(TensorBoardWriter(out / "tensorboard"))
    if cfg.logging.progress_bar:
        writers.append(ProgressBar(cfg.trainer.total_steps, start_step))
    return MetricsFanout(writers)


RESOLVED_CONFIG = "config.yaml"


def write_resolved_config(cfg: PSRLConfig, model_dir: str | Path) -> None:
    """The config as this run resolved it (the model as an absolute directory), into the run
    directory and beside the checkpoints, where ``psrl export`` finds it."""
    from psrl.config import to_yaml

    resolved = cfg.model_copy(deep=True)
    resolved.trainer.model_path = str(Path(model_dir).absolute())
    text = to_yaml(resolved)
    for d in (Path(cfg.logging.output_dir), Path(cfg.trainer.checkpoint_dir)):
        d.mkdir(parents=True, exist_ok=True)
        (d / RESOLVED_CONFIG).write_text(text)


def _sample_writer(cfg: PSRLConfig, tokenizer: Any) -> Any:
    if not cfg.logging.rollout_samples_every:
        return None
    from psrl.agent_loops.samples import RolloutSampleWriter
    from psrl.agent_loops.tool_parsers import make_tool_parser

    parser = make_tool_parser(cfg.gen_actor_rollout_ref.rollout.agent.tool_parser, tokenizer)
    return RolloutSampleWriter(
        Path(cfg.logging.output_dir) / "rollouts", every=cfg.logging.rollout_samples_every, tokenizer=tokenizer,
        per_step=cfg.logging.rollout_samples_per_step, tool_parser=parser,
    )


async def _watch_signals(scope: anyio.CancelScope, sched: Scheduler, flag: dict[str, bool]) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.warning("interrupted: stopping rollouts and saving a checkpoint", signal=signal.Signals(signum).name)
            flag["interrupted"] = True
            scope.cancel()
            # A terminal's Ctrl-C also reaches the engine processes, which may be gone already.
            sched.stop_step_within(STOP_GRACE_S)
            return


@dataclass
class RunParts:
    """What a launcher provides: the learner, the engines (one InferenceEngine, usually a Router)
    and the transfer queue's handle (``.connect()`` gives a client). Everything else is shared."""

    policy: PolicyTrainer
    engine: InferenceEngine
    queue: Any
    rollout: Any = None  # a GroupRollout run elsewhere (Ray rollout workers); None: a RolloutRunner here


# (cfg, schedule, stack) -> RunParts; whatever it opens is closed by ``stack``.
OpenParts = Callable[[PSRLConfig, ScheduleConfig, AsyncExitStack], Awaitable[RunParts]]


async def open_local_queue(cfg: PSRLConfig, sched_cfg: ScheduleConfig, stack: AsyncExitStack) -> Any:
    """The transfer queue's services as local processes, sized for this schedule (its eta)."""
    from psrl.transfer_queue import start_transfer_queue

    from .tq_queue import queue_config

    with _sigint_ignored():  # the queue's service processes inherit it: Ctrl-C is ours to handle
        return await stack.enter_async_context(start_transfer_queue(
            queue_config(cfg.transfer_queue, eta=sched_cfg.eta, samples_per_step=sched_cfg.samples_per_step)
        ))


async def open_local_parts(cfg: PSRLConfig, sched_cfg: ScheduleConfig, stack: AsyncExitStack) -> RunParts:
    """Every part on this machine: the Megatron trainer in process, vLLM replicas behind a Router,
    the transfer queue's services as processes."""
    from psrl.engines.factory import open_engine
    from psrl.models import resolve_model_path
    from psrl.trainer.trainer import MegatronTrainer

    from .megatron_policy import MegatronPolicy

    gen = cfg.gen_actor_rollout_ref
    model_dir = await anyio.to_thread.run_sync(resolve_model_path, cfg.trainer.model_path or gen.model.path)
    temperature = gen.rollout.sampling.temperature or 1.0  # log-probs of greedy sampling: T=1
    trainer = MegatronTrainer(model_dir, cfg.trainer, cfg.algorithm, temperature=temperature, critic=cfg.critic)
    stack.callback(trainer.close)
    if trainer.serves_adapters:
        served = await anyio.to_thread.run_sync(resolve_model_path, gen.model.path)
        if Path(served).resolve() != Path(model_dir).resolve():
            raise TrainingSetupError(f"trainer.lora: the engines serve {served}, the adapters are trained on {model_dir}; "
                                     "an adapter applies to its own base only (or set trainer.lora.merge_for_rollout=true)")
    # Version 0 = the weights on disk; on resume the scheduler syncs the restored policy first.
    # With served adapters the engines start as the base and get each version's adapter.
    engine = await stack.enter_async_context(open_engine(gen.rollout, gen.model, version=0,
                                                         lora_rank=cfg.trainer.lora.rank if trainer.serves_adapters else 0))
    handle = await open_local_queue(cfg, sched_cfg, stack)
    policy = MegatronPolicy(trainer, cfg.weight_sync)
    stack.push_async_callback(policy.aclose_publisher)
    return RunParts(policy, engine, handle)


async def train(cfg: PSRLConfig, *, on_ready: Any = None) -> int:
    """The whole run in this event loop (asyncio), every part on this machine."""
    return await run_pipeline(cfg, open_local_parts, on_ready=on_ready)


async def run_pipeline(cfg: PSRLConfig, open_parts: OpenParts, *, on_ready: Any = None) -> int:
    """Build the run around the parts ``open_parts`` provides and train. ``on_ready(scheduler)``
    is called once every part is up (tests use it to watch the run)."""
    from transformers import AutoTokenizer

    from psrl.agent_loops.runner import RolloutRunner
    from psrl.models import resolve_model_path
    from psrl.sandboxes.pool import SandboxPool

    from .tq_queue import TransferQueueGroups

    sched_cfg = schedule_config(cfg)
    gen, val = cfg.gen_actor_rollout_ref, cfg.train_actor_rollout_ref
    rows, val_rows = _load_data(cfg)
    ckpt_root = Path(cfg.trainer.checkpoint_dir).absolute()
    resume_from = checkpoint.latest(ckpt_root) if cfg.trainer.resume else None
    if cfg.trainer.resume and resume_from is None:
        raise TrainingSetupError(f"trainer.resume=true but {ckpt_root} holds no checkpoint")
    try:
        model_dir = await anyio.to_thread.run_sync(resolve_model_path, cfg.trainer.model_path or gen.model.path)
    except FileNotFoundError as e:
        raise TrainingSetupError(str(e)) from None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    write_resolved_config(cfg, model_dir)
    flag = {"interrupted": False}
    code = 0
    sink = None
    try:
        async with AsyncExitStack() as stack:
            parts = await open_parts(cfg, sched_cfg, stack)
            state = await anyio.to_thread.run_sync(checkpoint.load, resume_from, parts.policy) if resume_from else None
            start = int(state["version"]) if state else 0
            if state:
                log.info("resuming", checkpoint=str(resume_from), step=start)
            sink = _writers(cfg, start)
            client = await stack.enter_async_context(parts.queue.connect())
            runner, pool = parts.rollout, None
            if runner is None:
                pool = await stack.enter_async_context(SandboxPool(cfg.sandbox.spec, cfg.sandbox.pool))
                runner = RolloutRunner(
                    gen.rollout, tokenizer=tokenizer, sandbox_pool=pool, max_prompt_length=cfg.data.max_prompt_length,
                    validation_rollout=val.rollout, samples=_sample_writer(cfg, tokenizer),
                )
            sched = Scheduler(
                sched_cfg, engine=parts.engine, rollout=runner, trainer=parts.policy,
                queue=TransferQueueGroups(client, samples_per_step=sched_cfg.samples_per_step),
                tasks=TaskSource(rows, shuffle=cfg.data.shuffle, seed=cfg.data.seed), val_rows=val_rows,
                sink=sink if pool is None else WithCounters(sink, lambda: pool.statistics().metrics()),
                on_checkpoint=lambda state, queued: checkpoint.save(ckpt_root, state, parts.policy, queued=queued),
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
            except* Exception as eg:
                if not flag["interrupted"]:
                    raise
                # Ctrl-C reached the engine processes too: their failures while stopping are expected.
                log.warning("errors while stopping after the interrupt", error=repr(first_leaf(eg)))
            with anyio.CancelScope(shield=True):
                state, queued = await sched.snapshot(timeout_s=STOP_GRACE_S if flag["interrupted"] else 120.0)
                path = await anyio.to_thread.run_sync(
                    partial(checkpoint.save, ckpt_root, state, parts.policy, queued=queued)
                )
                log.info("checkpoint saved", path=str(path), step=sched.version)
                if cfg.trainer.export_hf and not flag["interrupted"]:
                    from psrl.trainer.export import export_checkpoint

                    hf = await anyio.to_thread.run_sync(export_checkpoint, path, Path(cfg.logging.output_dir) / "hf", model_dir)
                    log.info("exported a Hugging Face model", path=str(hf))
    except Exception as e:
        if not flag["interrupted"]:
            raise
        log.warning("errors while shutting down after the interrupt", error=repr(first_leaf(e)))
    finally:
        if sink is not None:
            sink.close()
    jsonl = Path(cfg.logging.output_dir) / "metrics.jsonl"
    if cfg.logging.jsonl and jsonl.is_file():
        png = plot_rewards(jsonl, Path(cfg.logging.output_dir) / "reward.png")
        log.info("reward plot written", path=str(png))
    return 130 if flag["interrupted"] else code
