"""``psrl rollout RECIPE.yaml [overrides]``: rollouts on a dataset, written to parquet.

Uses the training rollout subtree (``gen_actor_rollout_ref``): its model, engine, sampling
(``n`` episodes per row), multi-turn and agent settings; rows come from ``data.train_files``
(at most ``data.max_samples``), ``data.batch_size`` rows at a time. Trajectories go to the
output parquet in the trajectory Arrow schema, batch by batch; groups dropped by
``on_failure=drop_group`` go to ``<output stem>.dropped.parquet``, so nothing is lost.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio

from psrl.agent_loops.runner import RolloutRunner
from psrl.config import ConfigError, PSRLConfig
from psrl.environments.dataset import DatasetError, load_rows
from psrl.log import get_logger
from psrl.trajectory import TRAJECTORY_SCHEMA, Status, Trajectory, to_arrow

log = get_logger(__name__)


@dataclass(frozen=True)
class RolloutSummary:
    output: str
    episodes: int
    written: int
    dropped: int
    failed: int
    truncated: int
    reward_mean: float
    turns_mean: float
    tool_calls: float
    tool_errors: float
    generated_tokens: int
    wall_s: float
    tokens_per_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Tally:
    def __init__(self) -> None:
        self.trajs = 0
        self.reward = 0.0
        self.turns = 0
        self.failed = self.truncated = 0
        self.tool_calls = self.tool_errors = 0.0
        self.tokens = 0

    def add(self, t: Trajectory) -> None:
        self.trajs += 1
        self.reward += t.reward
        self.turns += t.num_turns
        self.failed += t.status is Status.FAILED
        self.truncated += t.status is Status.TRUNCATED
        self.tool_calls += t.env_metrics.get("tool_calls", 0.0)
        self.tool_errors += t.env_metrics.get("tool_errors", 0.0)
        self.tokens += int(t.loss_mask.sum())


class _ParquetOut:
    """A parquet file opened on the first write (so an empty side file is never made)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._writer: Any = None
        self.rows = 0

    def write(self, trajs: Sequence[Trajectory]) -> None:
        import pyarrow.parquet as pq

        if not trajs:
            return
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(self.path, TRAJECTORY_SCHEMA)
        self._writer.write_batch(to_arrow(trajs))
        self.rows += len(trajs)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _progress(enabled: bool, total: int) -> tuple[Any, Any]:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    progress = Progress(
        TextColumn("rollout"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
        console=Console(stderr=True), disable=not enabled, transient=False,
    )
    task = progress.add_task("rollout", total=total, info="")
    return progress, task


async def rollout(
    cfg: PSRLConfig,
    output: str,
    *,
    engine: Any = None,
    sandbox_pool: Any = None,
    tokenizer: Any = None,
) -> RolloutSummary:
    """The async body of :func:`run_rollout`. ``engine``, ``sandbox_pool`` and ``tokenizer``
    replace the ones built from the config (tests pass a ``ScriptedEngine``)."""
    gen = cfg.gen_actor_rollout_ref
    if not cfg.data.train_files:
        raise ConfigError("psrl rollout needs data.train_files (parquet or jsonl rows)")
    try:
        rows = load_rows(cfg.data.train_files, max_rows=cfg.data.max_samples)
    except DatasetError as e:
        raise ConfigError(str(e)) from None
    if tokenizer is None:
        tokenizer = await load_tokenizer(cfg)
    n = gen.rollout.sampling.n
    out_path = Path(output)
    kept_out, dropped_out = _ParquetOut(out_path), _ParquetOut(out_path.with_name(out_path.stem + ".dropped.parquet"))
    tally = _Tally()
    progress, bar = _progress(cfg.logging.progress_bar, len(rows) * n)

    def on_trajectory(t: Trajectory) -> None:
        tally.add(t)
        info = f"reward {tally.reward / tally.trajs:.3f}  failed {tally.failed}  tool errors {tally.tool_errors:g}"
        progress.update(bar, advance=1, info=info)

    start = time.perf_counter()
    async with contextlib.AsyncExitStack() as stack:
        runner, engine = await open_runner(stack, cfg, tokenizer, engine=engine, sandbox_pool=sandbox_pool)
        stack.callback(kept_out.close)
        stack.callback(dropped_out.close)
        stack.enter_context(progress)
        bs = cfg.data.batch_size
        gen_start = time.perf_counter()  # tokens/s counts rollout time, not engine start-up
        for b in range(0, len(rows), bs):
            result = await runner.run_batch(rows[b : b + bs], engine=engine, batch_id=f"b{b // bs}", on_trajectory=on_trajectory)
            kept_out.write(result.trajectories)
            dropped_out.write(result.dropped)
        rollout_s = time.perf_counter() - gen_start
    wall = time.perf_counter() - start
    summary = RolloutSummary(
        output=str(out_path), episodes=tally.trajs, written=kept_out.rows, dropped=dropped_out.rows,
        failed=tally.failed, truncated=tally.truncated,
        reward_mean=tally.reward / tally.trajs if tally.trajs else 0.0,
        turns_mean=tally.turns / tally.trajs if tally.trajs else 0.0,
        tool_calls=tally.tool_calls, tool_errors=tally.tool_errors, generated_tokens=tally.tokens,
        wall_s=wall, tokens_per_s=tally.tokens / rollout_s if rollout_s > 0 else 0.0,
    )
    log.info("rollout done", **summary.as_dict())
    return summary


async def load_tokenizer(cfg: PSRLConfig) -> Any:
    """The tokenizer of the training rollouts' model; a missing model is a ``ConfigError``."""
    from transformers import AutoTokenizer

    from psrl.models import resolve_model_path

    try:
        model_dir = await anyio.to_thread.run_sync(resolve_model_path, cfg.gen_actor_rollout_ref.model.path)
    except FileNotFoundError as e:
        raise ConfigError(f"gen_actor_rollout_ref.model.path: {e}") from None
    return AutoTokenizer.from_pretrained(model_dir)


async def open_runner(
    stack: contextlib.AsyncExitStack, cfg: PSRLConfig, tokenizer: Any, *, engine: Any = None, sandbox_pool: Any = None,
    validation: bool = False,
) -> tuple[RolloutRunner, Any]:
    """A ``RolloutRunner`` of the training rollout subtree and its engine, closed with ``stack``;
    ``engine`` and ``sandbox_pool``, when given, are used instead of ones built from the config.
    ``validation``: the runner also holds the validation subtree (``train_actor_rollout_ref``),
    used by ``run_group(..., validation=True)``; the engine is the training rollouts' one, as
    in ``psrl train``'s validation."""
    gen = cfg.gen_actor_rollout_ref
    if sandbox_pool is None:
        from psrl.sandboxes import SandboxPool

        # Started on the first acquire: a dataset whose env needs no sandbox never builds one.
        sandbox_pool = SandboxPool(cfg.sandbox.spec, cfg.sandbox.pool)
        stack.push_async_callback(sandbox_pool.aclose)
    try:
        runner = RolloutRunner(
            gen.rollout, tokenizer=tokenizer, sandbox_pool=sandbox_pool, max_prompt_length=cfg.data.max_prompt_length,
            validation_rollout=cfg.train_actor_rollout_ref.rollout if validation else None,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if engine is None:
        from psrl.engines.factory import open_engine

        try:
            engine = await stack.enter_async_context(open_engine(gen.rollout, gen.model))
        except ValueError as e:  # e.g. an engine type that is not built from config
            raise ConfigError(f"gen_actor_rollout_ref.rollout.engine: {e}") from None
    return runner, engine


def print_summary(summary: RolloutSummary, file: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="psrl rollout", show_header=False)
    rows = [
        ("output", summary.output + (f" (+{summary.dropped} dropped -> .dropped.parquet)" if summary.dropped else "")),
        ("episodes", f"{summary.episodes} ({summary.written} written, {summary.failed} failed, {summary.truncated} truncated)"),
        ("reward mean", f"{summary.reward_mean:.4f}"),
        ("turns mean", f"{summary.turns_mean:.2f}"),
        ("tool calls / errors", f"{summary.tool_calls:g} / {summary.tool_errors:g}"),
        ("generated tokens", str(summary.generated_tokens)),
        ("tokens/s", f"{summary.tokens_per_s:.1f}"),
        ("wall", f"{summary.wall_s:.1f} s"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    Console(file=file or sys.stdout).print(table)


def run_rollout(cfg: PSRLConfig, output: str, **kwargs: Any) -> RolloutSummary:
    """Run :func:`rollout` in a fresh event loop (asyncio: vLLM needs it) and print the summary."""
    summary = anyio.run(lambda: rollout(cfg, output, **kwargs), backend="asyncio")
    print_summary(summary)
    return summary
