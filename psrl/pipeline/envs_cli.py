"""The ``psrl envs new|validate`` and ``psrl data`` subcommands: arguments and dispatch.

``psrl envs`` alone still lists the registered components (``psrl.cli``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from dataclasses import dataclass

from psrl.config import ConfigError, load_config


@dataclass(frozen=True)
class Thresholds:
    max_zero_variance: float = 0.5
    max_crash_rate: float = 0.05
    max_timeout_rate: float = 0.05
    max_format_error_rate: float = 0.5
    max_tool_error_rate: float = 0.5
    max_streak: int = 4  # identical tool calls on consecutive turns


def add_envs_actions(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="envs_command", required=False, metavar="ACTION")
    new = sub.add_parser("new", help="scaffold an environment package: Environment, AgentData, dataset, test, recipe")
    new.add_argument("name", help="package name, a Python identifier (e.g. my_env)")
    new.add_argument("--dir", default=".", help="where to create it (default: here)")
    new.add_argument("--force", action="store_true", help="overwrite an existing directory")
    val = sub.add_parser("validate", help="run N groups and report whether an environment is fit to train on; exit 1 when a threshold is crossed")
    val.add_argument("recipe", nargs="?", default=None, help="recipe YAML (or give --env and --data)")
    val.add_argument("overrides", nargs="*", help="dotted overrides a.b.c=value")
    val.add_argument("--env", default=None, help="environment name or module.Class (with --data, instead of a recipe)")
    val.add_argument("--data", default=None, help="dataset file (.parquet/.jsonl) for --env")
    val.add_argument("--groups", type=int, default=8, help="dataset rows to run (default 8)")
    val.add_argument("-n", "--group-size", type=int, default=None, help="episodes per group (default: sampling.n, at least 2)")
    val.add_argument("--json", action="store_true", help="print the report as one JSON line")
    val.add_argument("--no-conformance", action="store_true", help="skip the scripted replay and check_environment")
    d = Thresholds()
    val.add_argument("--max-zero-variance", type=float, default=d.max_zero_variance, help=f"share of groups with equal rewards (default {d.max_zero_variance})")
    val.add_argument("--max-crash-rate", type=float, default=d.max_crash_rate, help=f"share of crashed episodes (default {d.max_crash_rate})")
    val.add_argument("--max-timeout-rate", type=float, default=d.max_timeout_rate, help=f"share of timed-out episodes (default {d.max_timeout_rate})")
    val.add_argument("--max-format-error-rate", type=float, default=d.max_format_error_rate, help=f"share of model turns with format errors (default {d.max_format_error_rate})")
    val.add_argument("--max-tool-error-rate", type=float, default=d.max_tool_error_rate, help=f"share of failed tool calls (default {d.max_tool_error_rate})")
    val.add_argument("--max-streak", type=int, default=d.max_streak, help=f"identical tool calls on consecutive turns (default {d.max_streak})")


def add_data_commands(p: argparse.ArgumentParser) -> None:
    from psrl.environments.reasoning_gym_env.data import add_arguments

    sub = p.add_subparsers(dest="data_command", required=True, metavar="SOURCE")
    add_arguments(sub.add_parser("reasoning-gym", help="rows from a reasoning-gym generator (reward: its scorer)"))
    from psrl.sft.cli import add_demo_parser

    add_demo_parser(sub)


def run_envs_new(args: argparse.Namespace) -> int:
    from psrl.environments.scaffold import scaffold

    try:
        root = scaffold(args.name, args.dir, force=args.force)
    except (ValueError, FileExistsError) as e:
        raise ConfigError(str(e)) from None
    rel = os.path.relpath(root)
    parent = os.path.relpath(root.parent)
    print(f"created {rel}/ (env.py, agent_data.py, data/train.jsonl, recipe.yaml, tests/). From {parent}:")
    print(f"  python -m pytest {args.name}/tests")
    print(f"  python -m psrl.cli envs validate {args.name}/recipe.yaml")
    return 0


def _validate_config(args: argparse.Namespace) -> Any:
    overrides = list(args.overrides)
    if args.recipe is not None and "=" in args.recipe and not args.recipe.endswith((".yaml", ".yml")):
        overrides.insert(0, args.recipe)  # only overrides were given
        args.recipe = None
    if args.env is not None:
        if args.data is None:
            raise ConfigError("--env needs --data (a .parquet or .jsonl dataset)")
        overrides += [f"*.rollout.agent.env.name={args.env}", f"data.train_files=[{args.data}]"]
    elif args.data is not None:
        overrides.append(f"data.train_files=[{args.data}]")
    if args.recipe is None and args.env is None:
        raise ConfigError("psrl envs validate needs a recipe YAML, or --env NAME --data FILE")
    cfg = load_config(args.recipe, overrides)
    n = args.group_size if args.group_size is not None else max(2, cfg.gen_actor_rollout_ref.rollout.sampling.n)
    if n < 2:
        raise ConfigError("--group-size must be at least 2: reward variance needs two episodes per group")
    return load_config(args.recipe, [*overrides, f"gen_actor_rollout_ref.rollout.sampling.n={n}"])


def run_envs_validate(args: argparse.Namespace) -> int:
    import anyio

    from psrl.pipeline.envs_validate import print_report, validate

    if os.getcwd() not in sys.path:  # a recipe names its env as pkg.module.Class, like `python -m` would find it
        sys.path.insert(0, os.getcwd())
    cfg = _validate_config(args)
    th = Thresholds(
        max_zero_variance=args.max_zero_variance, max_crash_rate=args.max_crash_rate, max_timeout_rate=args.max_timeout_rate,
        max_format_error_rate=args.max_format_error_rate, max_tool_error_rate=args.max_tool_error_rate, max_streak=args.max_streak,
    )  # fmt: skip
    if args.groups < 1:
        raise ConfigError(f"--groups must be at least 1, got {args.groups}")
    report = anyio.run(lambda: validate(cfg, groups=args.groups, thresholds=th, conformance=not args.no_conformance), backend="asyncio")
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        print_report(report)
    return 1 if report.crossed else 0


def run_data(args: argparse.Namespace) -> int:
    if args.data_command == "retool-demos":
        from psrl.sft.demos import run as run_demos

        try:
            return run_demos(args)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    from psrl.environments.reasoning_gym_env.data import run

    from psrl.environments.extras import MissingExtraError

    try:
        return run(args)
    except (ValueError, MissingExtraError) as e:
        raise ConfigError(str(e)) from None
