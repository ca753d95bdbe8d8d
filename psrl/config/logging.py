from __future__ import annotations

from typing import Literal

from .base import Section


class LoggingConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["console", "json"] = "console"
    output_dir: str = "runs/default"
    tensorboard: bool = True
    jsonl: bool = True
    progress_bar: bool = True
