"""Checkpoints of the whole pipeline: ``<checkpoint_dir>/step_<k>/`` holds ``pipeline.json``
(version, data-loader position with the rows to replay, counters, validation history, RNG),
``trainer/`` (the trainer's own checkpoint) and ``queue.arrow``, the groups that were generated and
waiting in the queue (every trajectory field), so a resumed run trains them without generating
them again. A step directory is written under a temporary name
and renamed when complete, so a crash mid-save leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa

from .protocols import PolicyTrainer

PIPELINE_FILE = "pipeline.json"
QUEUE_FILE = "queue.arrow"
FORMAT = 1


def _step_dirs(root: Path) -> list[Path]:
    dirs = [p for p in root.glob("step_*") if p.is_dir() and (p / PIPELINE_FILE).is_file() and p.name[5:].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name[5:]))


def latest(root: str | Path) -> Path | None:
    dirs = _step_dirs(Path(root))
    return dirs[-1] if dirs else None


def save(
    root: str | Path, state: dict[str, Any], trainer: PolicyTrainer, *, queued: pa.RecordBatch | None = None, keep: int = 2
) -> Path:
    """``queued``: the groups ``state["queued"]`` names (``Scheduler.snapshot``)."""
    root = Path(root)
    step = int(state["version"])
    final = root / f"step_{step:06d}"
    tmp = root / f".step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    trainer.save_checkpoint(str(tmp / "trainer"))
    if queued is not None and queued.num_rows:
        with pa.OSFile(str(tmp / QUEUE_FILE), "wb") as sink, pa.ipc.new_file(sink, queued.schema) as w:
            w.write_batch(queued)
    payload = {"format": FORMAT, **state, "python_random": _jsonable_random_state()}
    (tmp / PIPELINE_FILE).write_text(json.dumps(payload))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in _step_dirs(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load(path: str | Path, trainer: PolicyTrainer) -> dict[str, Any]:
    """Restore the trainer from a step directory and return the pipeline state (with the queued
    groups' data as ``state["queued_batch"]``, memory-mapped, or None)."""
    path = Path(path)
    try:
        state = json.loads((path / PIPELINE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable pipeline checkpoint ({e})") from None
    if state.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {state.get('format')!r}, this PSRL reads format {FORMAT}")
    trainer.load_checkpoint(str(path / "trainer"))
    random.setstate(_restore_random_state(state.pop("python_random")))
    queue_file = path / QUEUE_FILE
    state["queued_batch"] = pa.ipc.open_file(pa.memory_map(str(queue_file))).read_all() if queue_file.is_file() else None
    return state


def _jsonable_random_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _restore_random_state(saved: list) -> tuple:
    version, internal, gauss = saved
    return (version, tuple(internal), gauss)
