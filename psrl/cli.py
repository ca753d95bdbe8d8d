"""The ``psrl`` command: train, rollout, eval, export, sft, bench, envs, config, models.

Heavy modules (torch, vLLM, Megatron) are imported only by the subcommand that needs them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from psrl.config import ConfigError, load_config, to_yaml
from psrl.log import configure_logging
from psrl.pipeline import envs_cli
from psrl.registry import UnknownNameError

BENCHMARKS = {
    "engine": "benchmarks.engine",
    "sandbox": "benchmarks.sandbox",
    "agent-loop": "benchmarks.agent_loop",
    "queue": "benchmarks.queue",
    "trainer": "benchmarks.trainer",
    "weight-sync": "benchmarks.weight_sync",
    "gateway": "benchmarks.gateway",
    "pipeline": "benchmarks.pipeline",
}


class UsageError(Exception):
    """A user mistake: printed without a traceback, exit code 2."""


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe YAML, e.g. recipes/quickstart/config.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides a.b.c=value; '*.rollout.x=v' sets both rollout subtrees")
    p.add_argument("-v", "--verbose", action="store_true", help="show vLLM, Ray and Megatron logs in the terminal (logging.level=debug)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="psrl", description="Agentic reinforcement learning for language models.")
    parser.add_argument("--log-format", choices=["console", "json"], default=None, help="override logging.format")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="train a policy from a recipe")
    _recipe_args(p)

    p = sub.add_parser("rollout", help="run rollouts on a dataset and write trajectories to parquet")
    _recipe_args(p)
    p.add_argument("--output", "-o", default="rollouts.parquet", help="parquet file to write")

    p = sub.add_parser("serve", help="serve the policy through the session gateway (OpenAI API) for any harness")
    _recipe_args(p)
    p.add_argument("--port", type=int, default=None, help="loopback port (default: gateway.port; 0 picks a free one)")

    p = sub.add_parser("bench", help="throughput benchmarks; each prints a table and, with --json, one JSON line last")
    p.add_argument("name", choices=sorted(BENCHMARKS), help="which layer to measure")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark (see psrl bench NAME --help)")

    p = sub.add_parser("envs", help="list registered agent loops, environments, agent data, tool parsers and rewards; new; validate")
    envs_cli.add_envs_actions(p)
    envs_cli.add_data_commands(sub.add_parser("data", help="make dataset rows from task libraries (reasoning-gym) and ReTool demonstrations (retool-demos)"))

    p = sub.add_parser("config", help="inspect configs")
    csub = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = csub.add_parser("show", help="print the resolved config of a recipe with overrides")
    show.add_argument("recipe", nargs="?", default=None, help="recipe YAML (defaults when omitted)")
    show.add_argument("overrides", nargs="*")

    p = sub.add_parser("models", help="offline test models; check how closely engine, trainer and export agree on a model")
    msub = p.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    msub.add_parser("prepare", help="build the tiny models and smollm2-135m into the cache")
    path = msub.add_parser("path", help="print the local directory of an offline model (building it if needed)")
    path.add_argument("name")
    check = msub.add_parser("check", help="rollout/trainer agreement of a model: transformers vs Megatron logits, "
                                          "export round trip, vLLM vs trainer log-probs after a weight sync")
    check.add_argument("name", metavar="NAME_OR_PATH", help="an offline model name (tiny-qwen2, ...) or a local HF directory")
    check.add_argument("--skip-engine", action="store_true", help="no vLLM part (its figures are null)")
    check.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    check.add_argument("-v", "--verbose", action="store_true", help="show vLLM and Megatron logs in the terminal")

    from psrl.pipeline import eval_cmd, export_cmd, runs_show
    from psrl.sft import cli as sft_cli

    eval_cmd.add_parser(sub)
    export_cmd.add_parser(sub)
    runs_show.add_parser(sub)
    sft_cli.add_parser(sub)
    return parser


def _cmd_envs() -> int:
    from rich.console import Console
    from rich.table import Table

    import psrl.agent_loops as loops
    import psrl.environments as envs

    table = Table(title="registered components")
    table.add_column("kind")
    table.add_column("name")
    table.add_column("defined in")
    for kind, reg in (
        ("agent loop", loops.AGENT_LOOPS),
        ("environment", envs.ENVIRONMENTS),
        ("agent data", envs.AGENT_DATA),
        ("tool parser", loops.TOOL_PARSERS),
        ("reward", envs.REWARD_FUNCTIONS),
    ):
        for name in reg.names():
            table.add_row(kind, name, reg.describe(name))
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from psrl import models

    if args.models_command == "check":
        return _cmd_models_check(args)
    if args.models_command == "prepare":
        for name, path in models.prepare_all().items():
            print(f"{name}\t{path}")
    else:
        print(models.model_dir(args.name))
    return 0


def _cmd_models_check(args: argparse.Namespace) -> int:
    import json
    import os

    from psrl.models import cache_dir

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    if not args.verbose:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Loading weights" bars
    log_dir = cache_dir() / "logs" / "models-check"  # vLLM's, Megatron's and transformers' logs, unless -v
    configure_logging("debug" if args.verbose else "info", args.log_format or "console", log_dir=log_dir)
    from psrl.pipeline.models_check import check_model, format_table

    result = check_model(args.name, engine=not args.skip_engine)
    for error in result.errors:
        print(f"psrl: error: models check: {error}", file=sys.stderr)
    print(json.dumps(result.to_dict()) if args.json else format_table(result), flush=True)
    return 0 if result.ok else 1


def _cmd_bench(args: argparse.Namespace) -> int:
    module = importlib.import_module(BENCHMARKS[args.name])
    return int(module.main(list(args.args)) or 0)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def _sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM (``kill PID``, ``timeout``, a job scheduler) stops a command the way Ctrl-C does:
    engines, sandboxes and worker processes are shut down on the way out instead of being left
    running as orphans. A handler someone else installed is left alone."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    with _sigterm_as_ctrl_c():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may come on either side of options (`psrl rollout R.yaml -o x.parquet a.b=1`).
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command == "config":
            cfg = load_config(args.recipe, args.overrides)
            sys.stdout.write(to_yaml(cfg))
            return 0
        if args.command == "envs":
            if args.envs_command is not None:
                return envs_cli.run_envs_new(args) if args.envs_command == "new" else envs_cli.run_envs_validate(args)
            return _cmd_envs()
        if args.command == "data":
            return envs_cli.run_data(args)
        if args.command == "models":
            return _cmd_models(args)
        if args.command == "bench":
            return _cmd_bench(args)
        if args.command == "sft":
            from psrl.sft import cli as sft_cli

            return sft_cli.run(args)
        if args.command in ("export", "runs"):
            from psrl.pipeline import export_cmd, runs_show

            return (export_cmd if args.command == "export" else runs_show).run(args)
        cfg = load_config(args.recipe, args.overrides)
        level = "debug" if args.verbose else cfg.logging.level
        configure_logging(level, args.log_format or cfg.logging.format, log_dir=Path(cfg.logging.output_dir) / "logs")
        if args.command == "eval":
            from psrl.pipeline import eval_cmd

            return eval_cmd.run(cfg, args)
        if args.command == "rollout":
            from psrl.pipeline.rollout import run_rollout

            run_rollout(cfg, args.output)
            return 0
        if args.command == "serve":
            from psrl.serve.server import run_serve

            return run_serve(cfg, args.port)
        if args.command == "train":
            from psrl.pipeline.train import run_training

            return int(run_training(cfg) or 0)
    except (ConfigError, UnknownNameError, UsageError) as e:
        print(f"psrl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("psrl: interrupted", file=sys.stderr)
        return 130
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
