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
from typing import Any

CONFIG_NAME = "config.yaml"
_SEARCH_UP = 4  # a step dir sits at most root/step_N/trainer/step_M below the run's config


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a training checkpoint as a Hugging Face model directory")
    p.add_argument("checkpoint", help="trainer.checkpoint_dir, one of its step_* directories, or a trainer step directory")
    p.add_argument("-o", "--output", required=True, help="the Hugging Face directory to write")
    p.add_argument("--config", default=None, help=f"the run's config (default: {CONFIG_NAME} beside the checkpoint)")
    p.add_argument("--merge", action="store_true",
                   help="LoRA checkpoints: the base with the adapters merged in (default: a PEFT adapter directory)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights dtype (auto: the dtype of the model the run started from)")


def find_config(checkpoint: Path) -> Path | None:
    d = checkpoint.absolute()
    for _ in range(_SEARCH_UP + 1):
        if (d / CONFIG_NAME).is_file():
            return d / CONFIG_NAME
        d = d.parent
    return None


class ExportCommandError(Exception):
    """A checkpoint that cannot be exported: the message names what was wrong."""


def source_model_dir(checkpoint: str | Path, config: str | Path | None = None, *, fallback: Any = None) -> Path:
    """The Hugging Face directory the run behind ``checkpoint`` started from, read from the run's
    config (``config``, or the ``config.yaml`` found beside the checkpoint); ``fallback`` (a
    ``PSRLConfig``) is used when neither exists."""
    from psrl.config import ConfigError, load_config
    from psrl.models import resolve_model_path

    ckpt = Path(checkpoint)
    cfg_path = Path(config) if config else find_config(ckpt)
    if cfg_path is None and fallback is None:
        looked = [str((ckpt.absolute().parents[i - 1] if i else ckpt.absolute()) / CONFIG_NAME)
                  for i in range(min(_SEARCH_UP, len(ckpt.absolute().parents)) + 1)]
        raise ExportCommandError(f"no {CONFIG_NAME} beside the checkpoint (looked at {', '.join(looked)}); "
                                 "pass the run's config with --config")
    where = str(cfg_path) if cfg_path is not None else "the given config"
    try:
        cfg = load_config(cfg_path) if cfg_path is not None else fallback
        model = cfg.trainer.model_path or cfg.gen_actor_rollout_ref.model.path
        return Path(resolve_model_path(model))
    except (ConfigError, FileNotFoundError, OSError) as e:
        raise ExportCommandError(f"{where}: {e}") from None


def export_run_checkpoint(
    checkpoint: str | Path, output: str | Path, *, config: str | Path | None = None, fallback: Any = None, dtype: str = "auto",
    merge: bool = True,
) -> Path:
    """``psrl export``'s conversion (also behind ``psrl eval --checkpoint``): the checkpoint as a
    Hugging Face directory ``output``, built on the model the run started from. A LoRA checkpoint
    is merged into its base, or with ``merge=False`` written as a PEFT adapter directory."""
    from psrl.trainer.export import ExportError, export_checkpoint

    model_dir = source_model_dir(checkpoint, config, fallback=fallback)
    try:
        return export_checkpoint(checkpoint, output, model_dir, dtype=dtype, merge=merge)
    except (ExportError, FileNotFoundError) as e:
        raise ExportCommandError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    try:
        out = export_run_checkpoint(args.checkpoint, args.output, config=args.config, dtype=args.dtype, merge=args.merge)
    except ExportCommandError as e:
        print(f"psrl export: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
