"""``psrl export CHECKPOINT_DIR -o DIR [--config FILE]``: a checkpoint as a Hugging Face directory.

The run's config tells which model the run started from (its architecture, tokenizer, chat
template). ``psrl train`` writes the resolved config as ``config.yaml`` into the run directory and
into ``trainer.checkpoint_dir``; without ``--config`` it is looked up in the checkpoint directory
and the directories above it. The conversion itself is ``psrl.trainer.export``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

CONFIG_NAME = "config.yaml"
_SEARCH_UP = 4  # a step dir sits at most root/step_N/trainer/step_M below the run's config


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a training checkpoint as a Hugging Face model directory")
    p.add_argument("checkpoint", help="trainer.checkpoint_dir, one of its step_* directories, or a trainer step directory")
    p.add_argument("-o", "--output", required=True, help="the Hugging Face directory to write")
    p.add_argument("--config", default=None, help=f"the run's config (default: {CONFIG_NAME} beside the checkpoint)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights dtype (auto: the dtype of the model the run started from)")


def find_config(checkpoint: Path) -> Path | None:
    d = checkpoint.absolute()
    for _ in range(_SEARCH_UP + 1):
        if (d / CONFIG_NAME).is_file():
            return d / CONFIG_NAME
        d = d.parent
    return None


def run(args: argparse.Namespace) -> int:
    from psrl.config import ConfigError, load_config
    from psrl.models import resolve_model_path

    ckpt = Path(args.checkpoint)
    cfg_path = Path(args.config) if args.config else find_config(ckpt)
    if cfg_path is None:
        looked = [str((ckpt.absolute().parents[i - 1] if i else ckpt.absolute()) / CONFIG_NAME)
                  for i in range(min(_SEARCH_UP, len(ckpt.absolute().parents)) + 1)]
        print(f"psrl export: error: no {CONFIG_NAME} beside the checkpoint (looked at {', '.join(looked)}); "
              "pass the run's config with --config", file=sys.stderr)
        return 2
    try:
        cfg = load_config(cfg_path)
        model = cfg.trainer.model_path or cfg.gen_actor_rollout_ref.model.path
        model_dir = resolve_model_path(model)
    except (ConfigError, FileNotFoundError, OSError) as e:
        print(f"psrl export: error: {cfg_path}: {e}", file=sys.stderr)
        return 2
    from psrl.trainer.export import ExportError, export_checkpoint

    try:
        out = export_checkpoint(ckpt, args.output, model_dir, dtype=args.dtype)
    except (ExportError, FileNotFoundError) as e:
        print(f"psrl export: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
