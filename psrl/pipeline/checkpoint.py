"""Checkpoints of the whole pipeline: ``<checkpoint_dir>/step_<k>/`` holds ``pipeline.json``
(version, data-loader position with the rows to replay, counters, validation history, RNG) and
``trainer/`` (the trainer's own checkpoint). A step directory is written under a temporary name
and renamed when complete, so a crash mid-save leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

from .protocols import PolicyTrainer

PIPELINE_FILE = "pipeline.json"
FORMAT = 1


def _step_dirs(root: Path) -> list[Path]:
    dirs = [p for p in root.glob("step_*") if p.is_dir() and (p / PIPELINE_FILE).is_file() and p.name[5:].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name[5:]))


def latest(root: str | Path) -> Path | None:
    dirs = _step_dirs(Path(root))
    return dirs[-1] if dirs else None


def save(root: str | Path, state: dict[str, Any], trainer: PolicyTrainer, *, keep: int = 2) -> Path:
    root = Path(root)
    step = int(state["version"])
    final = root / f"step_{step:06d}"
    tmp = root / f".step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    trainer.save_checkpoint(str(tmp / "trainer"))
    payload = {"format": FORMAT, **state, "python_random": _jsonable_random_state()}
    (tmp / PIPELINE_FILE).write_text(json.dumps(payload))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in _step_dirs(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load(path: str | Path, trainer: PolicyTrainer) -> dict[str, Any]:
    """Restore the trainer from a step directory and return the pipeline state."""
    path = Path(path)
    try:
        state = json.loads((path / PIPELINE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable pipeline checkpoint ({e})") from None
    if state.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {state.get('format')!r}, this PSRL reads format {FORMAT}")
    trainer.load_checkpoint(str(path / "trainer"))
    random.setstate(_restore_random_state(state.pop("python_random")))
    return state


def _jsonable_random_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _restore_random_state(saved: list) -> tuple:
    version, internal, gauss = saved
    return (version, tuple(internal), gauss)
