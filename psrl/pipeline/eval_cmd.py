"""``psrl eval CONFIG [--checkpoint DIR | --model PATH] [--data FILE] [-o DIR] [overrides]``.

Runs a config's validation rollouts (the ``train_actor_rollout_ref`` subtree: its sampling, ``n``
episodes per row, agent loop and environment) on ``data.val_files`` or ``--data``, against

- the config's own model (no option): the base model;
- ``--model PATH``: any Hugging Face directory, offline model name or cached hub id;
- ``--checkpoint DIR``: a ``psrl train`` checkpoint, converted first by ``psrl export``'s code
  (``export_cmd.export_run_checkpoint``) into ``OUTPUT/hf``, which the engine then serves.

The engine is built from ``gen_actor_rollout_ref`` as in ``psrl train``'s validation. Episodes
run through ``psrl rollout``'s runner. Reported per ``data_source`` and over all rows: mean
reward, pass@k for k = 1, 2, 4, ... up to ``n`` (the unbiased estimator of Chen et al. 2021;
an episode passes when its reward reaches ``--pass-threshold``), tool calls and the episode
rates of ``psrl envs validate`` (``metrics.episode_rates``). Written to ``OUTPUT/eval.json``;
every episode to ``OUTPUT/samples.parquet`` (the trajectory Arrow schema, which ``psrl sft``
and ``psrl.trajectory.from_arrow`` read, plus decoded ``prompt_text`` and ``response_text``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from psrl.config import ConfigError, PSRLConfig
from psrl.trajectory import Trajectory

from .metrics import PASS_THRESHOLD, episode_rates

ALL = "all"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="measure a checkpoint or model on a config's validation rollouts (or any dataset)")
    p.add_argument("recipe", help="recipe YAML whose validation rollouts (train_actor_rollout_ref) to run")
    p.add_argument("overrides", nargs="*", help="dotted overrides a.b.c=value")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--checkpoint", default=None, help="a psrl train checkpoint (trainer.checkpoint_dir or a step in it)")
    which.add_argument("--model", default=None, help="a Hugging Face model directory, offline model name or hub id")
    p.add_argument("--data", action="append", default=None, help="dataset file(s) to evaluate on (default: data.val_files)")
    p.add_argument("-o", "--output", default=None, help="output directory (default: <logging.output_dir>/eval)")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N rows")
    p.add_argument("--pass-threshold", type=float, default=1.0, help="an episode passes when its reward is at least this (default 1.0)")
    p.add_argument("--config", default=None, help="with --checkpoint: the run's config (default: config.yaml beside the checkpoint, else RECIPE)")
    p.add_argument("-v", "--verbose", action="store_true", help="show vLLM logs in the terminal (logging.level=debug)")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of P(at least one of k samples passes) from n samples, c passing:
    1 - C(n-c, k) / C(n, k), as a product so that large n does not overflow."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def k_values(n: int) -> list[int]:
    """1, 2, 4, ... below ``n``, and ``n``."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n] if n >= 1 else []


@dataclass
class SourceStats:
    groups: int = 0
    episodes: int = 0
    reward_mean: float = 0.0
    reward_std: float = 0.0
    pass_at_k: dict[str, float] = field(default_factory=dict)
    turns_mean: float = 0.0
    response_tokens_mean: float = 0.0
    tool_calls: float = 0.0
    tool_calls_per_episode: float = 0.0
    tool_error_rate: float = 0.0
    format_error_rate: float = 0.0
    timeout_rate: float = 0.0
    crash_rate: float = 0.0
    truncated_rate: float = 0.0


def source_stats(groups: Sequence[Sequence[Trajectory]], *, pass_threshold: float = 1.0) -> SourceStats:
    """Stats of a set of groups. pass@k averages over the groups that have at least k episodes."""
    import numpy as np

    trajs = [t for g in groups for t in g]
    if not trajs:
        return SourceStats(groups=len(groups))
    rewards = np.array([t.reward for t in trajs], np.float64)
    tol = pass_threshold - (1.0 - PASS_THRESHOLD)  # "reaches 1.0" tolerates float noise, as training's pass rate does
    per_k: dict[int, list[float]] = {}
    for g in groups:
        c = sum(t.reward >= tol for t in g)
        for k in k_values(len(g)):
            per_k.setdefault(k, []).append(pass_at_k(len(g), c, k))
    rates = episode_rates(trajs)
    return SourceStats(
        groups=len(groups), episodes=len(trajs), reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
        pass_at_k={f"pass@{k}": float(np.mean(v)) for k, v in sorted(per_k.items())},
        turns_mean=rates.turns / len(trajs), response_tokens_mean=float(np.mean([int(t.loss_mask.sum()) for t in trajs])),
        tool_calls=rates.tool_calls, tool_calls_per_episode=rates.tool_calls / len(trajs), tool_error_rate=rates.tool_error_rate,
        format_error_rate=rates.format_error_rate, timeout_rate=rates.timeout_rate, crash_rate=rates.crash_rate,
        truncated_rate=rates.truncated_rate,
    )


def stats_by_source(groups: Sequence[Sequence[Trajectory]], *, pass_threshold: float = 1.0) -> dict[str, SourceStats]:
    """``source_stats`` per ``data_source`` (a group's first episode names it), then ``all``."""
    by: dict[str, list[Sequence[Trajectory]]] = {}
    for g in groups:
        if g:
            by.setdefault(g[0].data_source or "unknown", []).append(g)
    out = {src: source_stats(gs, pass_threshold=pass_threshold) for src, gs in sorted(by.items())}
    out[ALL] = source_stats(groups, pass_threshold=pass_threshold)
    return out


def _samples_table(trajs: Sequence[Trajectory], tokenizer: Any) -> Any:
    import pyarrow as pa

    from psrl.trajectory import to_arrow

    table = pa.Table.from_batches([to_arrow(trajs)])
    decode = lambda ids: tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)  # noqa: E731
    table = table.append_column("prompt_text", pa.array([decode(t.prompt_ids) for t in trajs], pa.string()))
    return table.append_column("response_text", pa.array([decode(t.response_ids) for t in trajs], pa.string()))


async def evaluate(
    cfg: PSRLConfig, rows: Sequence[Mapping[str, Any]], output_dir: str | Path, *,
    pass_threshold: float = 1.0, info: Mapping[str, Any] | None = None, engine: Any = None, tokenizer: Any = None,
) -> dict[str, Any]:
    """Run every row's validation group, write ``eval.json`` and ``samples.parquet`` into
    ``output_dir`` and return what ``eval.json`` holds. ``engine``/``tokenizer`` replace the
    ones built from the config (tests share one engine)."""
    import anyio
    import pyarrow.parquet as pq

    from .rollout import _progress, load_tokenizer, open_runner

    if not rows:
        raise ConfigError("psrl eval: the dataset has no rows")
    if tokenizer is None:
        tokenizer = await load_tokenizer(cfg)
    n = cfg.train_actor_rollout_ref.rollout.sampling.n
    groups: list[list[Trajectory]] = [[] for _ in rows]
    start = time.perf_counter()
    async with contextlib.AsyncExitStack() as stack:
        runner, engine = await open_runner(stack, cfg, tokenizer, engine=engine, validation=True)
        progress, bar = _progress(cfg.logging.progress_bar, len(rows) * n)  # after start-up: its clock times rollouts
        stack.enter_context(progress)
        gen_start = time.perf_counter()

        async def one(i: int, row: Mapping[str, Any]) -> None:
            groups[i] = await runner.run_group(
                row, group_id=f"eval{i}", n=n, engine=engine, validation=True, on_trajectory=lambda _: progress.advance(bar),
            )

        async with anyio.create_task_group() as tg:
            for i, row in enumerate(rows):
                tg.start_soon(one, i, row)
        rollout_s = time.perf_counter() - gen_start
    trajs = [t for g in groups for t in g]
    stats = stats_by_source(groups, pass_threshold=pass_threshold)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(_samples_table(trajs, tokenizer), out / "samples.parquet")
    errors = list(dict.fromkeys((t.error or "")[:300] for t in trajs if t.error))[:5]
    result = {
        **(info or {}), "rows": len(rows), "n": n, "pass_threshold": pass_threshold,
        "sources": {k: asdict(v) for k, v in stats.items()}, "errors": errors,
        "rollout_s": round(rollout_s, 2), "wall_s": round(time.perf_counter() - start, 2),
    }
    (out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def prepare(cfg: PSRLConfig, args: argparse.Namespace) -> tuple[PSRLConfig, list[dict[str, Any]], Path, dict[str, Any]]:
    """Resolve the options: the config with the model to evaluate, the rows, the output
    directory and what ``eval.json`` records about them. Bad options raise ``ConfigError``
    before any engine starts; a checkpoint is exported here."""
    from psrl.environments.dataset import DatasetError, load_rows

    from .export_cmd import ExportCommandError, export_run_checkpoint

    if args.config is not None and args.checkpoint is None:
        raise ConfigError("--config only applies with --checkpoint")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {args.limit}")
    files = args.data or cfg.data.val_files
    if not files:
        raise ConfigError("psrl eval needs a dataset: set data.val_files in the config or pass --data FILE")
    try:
        rows = load_rows(files, max_rows=args.limit)
    except DatasetError as e:
        raise ConfigError(f"psrl eval: {e}") from None
    out = Path(args.output) if args.output else Path(cfg.logging.output_dir) / "eval"
    info: dict[str, Any] = {"config": str(args.recipe), "data": [str(f) for f in files]}
    cfg = cfg.model_copy(deep=True)
    if args.checkpoint is not None:
        if not Path(args.checkpoint).exists():
            raise ConfigError(f"--checkpoint {args.checkpoint}: no such directory")
        try:
            model = str(export_run_checkpoint(args.checkpoint, out / "hf", config=args.config, fallback=cfg))
        except ExportCommandError as e:
            raise ConfigError(f"--checkpoint {args.checkpoint}: {e}") from None
        info["checkpoint"] = str(Path(args.checkpoint).absolute())
    elif args.model is not None:
        from psrl.models import resolve_model_path

        try:
            model = resolve_model_path(args.model)
        except FileNotFoundError as e:
            raise ConfigError(f"--model: {e}") from None
    else:
        model = cfg.gen_actor_rollout_ref.model.path
    cfg.gen_actor_rollout_ref.model.path = model
    cfg.train_actor_rollout_ref.model.path = model
    info["model"] = model
    return cfg, rows, out, info


def print_result(result: Mapping[str, Any], file: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    sources = result["sources"]
    ks = list(sources[ALL]["pass_at_k"])
    table = Table(title=f"psrl eval  {result.get('model', '')}  ({result['rows']} rows x {result['n']}, {result['wall_s']:.0f} s)")
    for col in ["data_source", "episodes", "reward", *ks, "tool calls/ep", "tool err", "format err", "timeouts", "crashes", "truncated"]:
        table.add_column(col, justify="left" if col == "data_source" else "right")
    for src, s in sources.items():
        table.add_row(
            src, str(s["episodes"]), f"{s['reward_mean']:.4f}", *(f"{s['pass_at_k'].get(k, float('nan')):.3f}" for k in ks),
            f"{s['tool_calls_per_episode']:.2f}", f"{s['tool_error_rate']:.0%}", f"{s['format_error_rate']:.0%}",
            f"{s['timeout_rate']:.0%}", f"{s['crash_rate']:.0%}", f"{s['truncated_rate']:.0%}",
            end_section=src != ALL and len(sources) > 2 and src == list(sources)[-2],
        )
    console = Console(file=file or sys.stdout, width=160)
    console.print(table)
    for e in result.get("errors", []):
        console.print(f"error: {e}", markup=False)


def run(cfg: PSRLConfig, args: argparse.Namespace) -> int:
    import anyio

    if os.getcwd() not in sys.path:  # a recipe may name its env as pkg.module.Class
        sys.path.insert(0, os.getcwd())
    cfg, rows, out, info = prepare(cfg, args)
    result = anyio.run(lambda: evaluate(cfg, rows, out, pass_threshold=args.pass_threshold, info=info), backend="asyncio")
    print_result(result)
    print(f"wrote {out / 'eval.json'} and {out / 'samples.parquet'}")
    return 0
