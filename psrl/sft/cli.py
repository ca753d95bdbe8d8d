"""Arguments of ``psrl sft CONFIG [overrides]`` and ``psrl data retool-demos``."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sft", help="supervised fine-tuning from chat rows or rollout trajectories (the sft section)")
    p.add_argument("recipe", help="config YAML with an sft section, e.g. recipes/retool/sft.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides a.b.c=value, e.g. sft.epochs=2")
    p.add_argument("-v", "--verbose", action="store_true", help="show Megatron logs in the terminal (logging.level=debug)")


def add_demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("retool-demos", help="ReTool cold-start demonstrations through the real rollout path (rewarded ones only)")
    p.add_argument("-o", "--output", required=True, help="trajectories parquet to write (psrl sft reads it)")
    p.add_argument("--rows", type=int, default=96, help="tasks to attempt (default 96)")
    p.add_argument("--seed", type=int, default=0, help="task and wording seed (default 0)")
    p.add_argument("--config", default="recipes/retool/config.yaml", help="the ReTool recipe whose rollout settings to use")
    p.add_argument("overrides", nargs="*", help="dotted overrides of that config")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from psrl.config import load_config
    from psrl.log import configure_logging

    from .run import run_sft

    cfg = load_config(args.recipe, args.overrides)
    configure_logging("debug" if args.verbose else cfg.logging.level, args.log_format or cfg.logging.format,
                      log_dir=Path(cfg.sft.save_dir) / "logs")
    run_sft(cfg)
    return 0
