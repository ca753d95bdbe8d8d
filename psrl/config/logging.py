from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class LoggingConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["console", "json"] = "console"
    output_dir: str = "runs/default"
    tensorboard: bool = True
    jsonl: bool = True
    progress_bar: bool = True
    # Every this many steps, up to rollout_samples_per_step training rollouts as text go to
    # OUTPUT_DIR/rollouts/step_N.jsonl (read them with `psrl runs show`); 0 turns it off.
    rollout_samples_every: int = Field(default=10, ge=0)
    rollout_samples_per_step: int = Field(default=8, ge=1)
