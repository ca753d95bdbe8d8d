"""What a train step reports: its metrics, assembled here from the consumed batch
(``batch_metrics``), the trainer's own numbers, the readings of the scheduler's clock through the
step and the engine's request timings; the record the scheduler keeps of each step; and the sink
the metrics go to."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from psrl.log import get_logger

from .metrics import batch_metrics
from .schedule_config import ScheduleConfig
from .timed_engine import RequestTiming, request_metrics

log = get_logger("psrl.pipeline")


class MetricsSink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float], *, kind: Literal["train", "val"]) -> None: ...


@dataclass
class StepRecord:
    step: int  # 1-based: the version this step produced
    group_ids: list[str]
    rows: list[int]  # dataset rows trained on
    staleness_max: int
    wall_s: float


@dataclass(frozen=True)
class StepTimes:
    """The scheduler's clock through one train step, in order."""

    last: float  # the step before was synced (or the train loop began)
    start: float  # the trainer began to wait for its batch
    taken: float
    paused: float  # the engines were paused (colocated only; else right after ``taken``)
    trained: float
    synced: float  # the new weights were published and the engines resumed

    @property
    def wall_s(self) -> float:
        return self.synced - self.last


def log_first_error(batch: pa.RecordBatch, what: str, step: int) -> None:
    if "error" not in batch.schema.names:
        return
    errors = [e for e in batch.column("error").to_pylist() if e]
    if errors:
        log.warning(what, step=step, count=len(errors), first_error=errors[0])


def step_metrics(
    batch: pa.RecordBatch,
    cfg: ScheduleConfig,
    *,
    version: int,
    step: int,
    trained: Mapping[str, float],
    times: StepTimes,
    generation_busy_s: float,
    requests: tuple[list[RequestTiming], int],
    group_s: Sequence[float],
    totals: Mapping[str, float],
) -> dict[str, float]:
    """The metrics of the train step that consumed ``batch`` at ``version`` and produced ``step``:
    the batch's, the trainer's (``train/``), where the step's time went (``time/``), what the
    pipeline model is fitted from, throughput, then the run's ``totals`` and its version."""
    metrics = batch_metrics(batch, version=version)
    if metrics.get("episodes/failed"):
        log_first_error(batch, "training episodes failed", step)
    metrics.update({f"train/{k}": float(v) for k, v in trained.items()})
    wall = times.wall_s
    metrics.update({
        "time/step_s": wall,
        "time/queue_wait_s": times.taken - times.start,
        "time/train_s": times.trained - times.taken,
        "time/pause_s": times.paused - times.taken,  # inside train_s: pausing the engines (colocated)
        "time/weight_sync_s": times.synced - times.trained,
        "time/generation_busy_s": generation_busy_s,
        **model_metrics(batch, cfg, requests, group_s),
        "throughput/samples_per_s": batch.num_rows / wall if wall > 0 else 0.0,
        "throughput/tokens_per_s": metrics["tokens/generated"] / wall if wall > 0 else 0.0,
        **totals,
        "version": float(step),
    })
    return metrics


def model_metrics(
    batch: pa.RecordBatch, cfg: ScheduleConfig, requests: tuple[list[RequestTiming], int], group_s: Sequence[float],
) -> dict[str, float]:
    """What the pipeline model is fitted from (``psrl bench pipeline --calibrate``): per-request
    generation time and length, rollout time per group, trained tokens, and the setting."""
    out = request_metrics(*requests)
    if group_s:
        out["gen/group_s_mean"], out["gen/group_s_max"] = sum(group_s) / len(group_s), max(group_s)
    if "prompt_ids" in batch.schema.names:
        out["tokens/prompt_mean"] = float(pc.mean(pc.list_value_length(batch.column("prompt_ids"))).as_py() or 0.0)
    out.update({
        "pipeline/eta": float(cfg.eta), "pipeline/colocated": float(cfg.colocated),
        "pipeline/shared_hardware": float(cfg.shared_hardware),
        "pipeline/groups_per_step": float(cfg.groups_per_step), "pipeline/group_size": float(cfg.group_size),
    })
    return out
