"""Per-step metrics computed from the columns of a consumed batch, and the failure-rate guard."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from psrl.trajectory import NO_VERSION, Status, Trajectory

# The trajectory columns the metrics read, fetched beside whatever the trainer needs: scalars
# only (``psrl.trajectory.DERIVED_FIELDS`` are computed where a trajectory is produced), so the
# driver's share of a step does not grow with sequence length.
METRIC_FIELDS: tuple[str, ...] = (
    "group_id", "reward", "status", "error", "env_metrics", "loss_tokens", "num_turns", "min_version", "max_version",
    "produced_by", "data_source",
)
PASS_THRESHOLD = 1.0 - 1e-6  # a sample "passes" when its reward is (numerically) full


# Environment metrics that count a model turn the environment could not read as an action.
FORMAT_METRICS = ("format_errors", "parse_errors", "invalid_moves")


@dataclass(frozen=True)
class EpisodeRates:
    """Per-episode rates of a set of finished trajectories (``psrl envs validate``, ``psrl eval``).

    Format errors are counted over model turns (env metrics ``FORMAT_METRICS``), tool errors over
    tool calls (``tool_errors`` / ``tool_calls``); timeouts and crashes are FAILED episodes (a
    timeout's error says "timed out"), over episodes, as is truncation.
    """

    episodes: int = 0
    turns: int = 0
    tool_calls: float = 0.0
    tool_errors: float = 0.0
    format_error_rate: float = 0.0
    tool_error_rate: float = 0.0
    timeout_rate: float = 0.0
    crash_rate: float = 0.0
    truncated_rate: float = 0.0


def episode_rates(trajs: Sequence[Trajectory]) -> EpisodeRates:
    n = len(trajs)
    if not n:
        return EpisodeRates()
    turns = sum(t.num_turns for t in trajs)
    calls = sum(t.env_metrics.get("tool_calls", 0.0) for t in trajs)
    errors = sum(t.env_metrics.get("tool_errors", 0.0) for t in trajs)
    failed = [t for t in trajs if t.status is Status.FAILED]
    timeouts = sum("timed out" in (t.error or "") for t in failed)
    return EpisodeRates(
        episodes=n, turns=turns, tool_calls=calls, tool_errors=errors,
        format_error_rate=sum(t.env_metrics.get(k, 0.0) for t in trajs for k in FORMAT_METRICS) / turns if turns else 0.0,
        tool_error_rate=errors / calls if calls else 0.0,
        timeout_rate=timeouts / n, crash_rate=(len(failed) - timeouts) / n,
        truncated_rate=sum(t.status is Status.TRUNCATED for t in trajs) / n,
    )


def _env_sum(env_metrics: Sequence[Mapping[str, float]], *names: str) -> float:
    return float(sum(m.get(n, 0.0) for m in env_metrics for n in names))


def _ints(batch: pa.RecordBatch, name: str) -> np.ndarray:
    return np.asarray(batch.column(name).to_numpy(zero_copy_only=False), np.int64)


def batch_metrics(batch: pa.RecordBatch, *, version: int, prefix: str = "") -> dict[str, float]:
    """Reward mean/std/pass rate, lengths, turns, tool errors, failures and staleness of a batch.

    ``version`` is the policy version the trainer steps from: a sample's staleness is ``version``
    minus the oldest version among its generated tokens (``min_version``).
    """
    cols = set(batch.schema.names)
    missing = [f for f in ("reward", "loss_tokens", "min_version", "max_version") if f not in cols]
    if missing:
        raise KeyError(f"batch_metrics needs the columns {missing}")
    rewards = np.asarray(batch.column("reward").to_numpy(zero_copy_only=False), np.float64)
    gen_tokens = _ints(batch, "loss_tokens")
    out: dict[str, float] = {
        "samples": float(len(rewards)),
        "reward/mean": float(rewards.mean()) if len(rewards) else 0.0,
        "reward/std": float(rewards.std()) if len(rewards) else 0.0,
        "reward/pass_rate": float((rewards >= PASS_THRESHOLD).mean()) if len(rewards) else 0.0,
        "response_length/mean": float(gen_tokens.mean()) if len(gen_tokens) else 0.0,
        "response_length/max": float(gen_tokens.max()) if len(gen_tokens) else 0.0,
        "tokens/generated": float(gen_tokens.sum()),
    }
    if "num_turns" in cols:
        turns = _ints(batch, "num_turns")
        out["turns/mean"] = float(turns.mean()) if len(turns) else 0.0
    if "status" in cols:
        status = batch.column("status").to_pylist()
        out["episodes/failed"] = float(sum(s == Status.FAILED for s in status))
        out["episodes/truncated"] = float(sum(s == Status.TRUNCATED for s in status))
    if "env_metrics" in cols:
        env = [dict(m or []) for m in batch.column("env_metrics").to_pylist()]
        calls = _env_sum(env, "tool_calls")
        errors = _env_sum(env, "tool_errors", "tool_call_errors", "parse_errors")
        out["tools/calls"] = calls
        out["tools/error_rate"] = errors / calls if calls else 0.0
        for name in ("env_time_s", "generate_time_s"):
            if any(name in m for m in env):
                out[f"time/episode_{name}"] = _env_sum(env, name) / max(len(env), 1)
    out.update(env_metric_means(batch))
    zero_key = "zero_variance_groups" if prefix else "train/zero_variance_groups"
    out[zero_key] = float(zero_variance_groups(batch))
    if "produced_by" in cols:  # "<worker>@<node id>"; empty for the driver's own runner
        where = [w for w in batch.column("produced_by").to_pylist() if w]
        out["rollout/workers"] = float(len(set(where)))
        out["rollout/nodes"] = float(len({w.rpartition("@")[2] for w in where}))
    oldest, newest = _ints(batch, "min_version"), _ints(batch, "max_version")
    generated = oldest != NO_VERSION
    stale = version - oldest[generated]
    out["staleness/max"] = float(stale.max()) if len(stale) else 0.0
    out["staleness/mean"] = float(stale.mean()) if len(stale) else 0.0
    out["staleness/mixed_version_samples"] = float(np.count_nonzero(generated & (newest != oldest)))
    for s, count in zip(*np.unique(stale, return_counts=True), strict=True):
        out[f"staleness/hist/{int(s)}"] = float(count)
    return {f"{prefix}{k}": v for k, v in out.items()} if prefix else out


def env_metric_means(batch: pa.RecordBatch) -> dict[str, float]:
    """Every numeric environment metric as ``env/<name>`` (mean over the samples that report it)
    and ``env/<data_source>/<name>`` per data source, beside ``reward/<data_source>/mean``: a
    task's own signals next to its reward show a reward rising while the task's logic does not."""
    cols = set(batch.schema.names)
    if "env_metrics" not in cols:
        return {}
    env = [dict(m or []) for m in batch.column("env_metrics").to_pylist()]
    sources = batch.column("data_source").to_pylist() if "data_source" in cols else [""] * len(env)
    rewards = batch.column("reward").to_pylist() if "reward" in cols else None
    sums: dict[str, list[float]] = {}
    for i, (m, src) in enumerate(zip(env, sources, strict=True)):
        src = (src or "unknown").replace("/", "_")
        if rewards is not None:
            sums.setdefault(f"reward/{src}/mean", []).append(float(rewards[i]))
        for name, value in m.items():
            if value is None or not np.isfinite(value):
                continue
            sums.setdefault(f"env/{name}", []).append(float(value))
            sums.setdefault(f"env/{src}/{name}", []).append(float(value))
    return {k: float(np.mean(v)) for k, v in sorted(sums.items())}


def zero_variance_groups(batch: pa.RecordBatch) -> int:
    """Groups (of two or more samples) whose rewards are all equal: GRPO learns nothing from them."""
    if "group_id" not in batch.schema.names:
        return 0
    by_group: dict[str, list[float]] = {}
    for g, r in zip(batch.column("group_id").to_pylist(), batch.column("reward").to_pylist(), strict=True):
        by_group.setdefault(g, []).append(float(r))
    return sum(len(rs) > 1 and max(rs) - min(rs) <= 1e-9 for rs in by_group.values())


def staleness_histogram(metrics: Mapping[str, float], prefix: str = "") -> dict[int, int]:
    head = f"{prefix}staleness/hist/"
    return {int(k[len(head):]): int(v) for k, v in metrics.items() if k.startswith(head)}


def first_leaf(exc: BaseException) -> BaseException:
    """The first non-group exception inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


class FailureRateExceeded(RuntimeError):
    """Too many episodes failed: the run stops with this message (exit code 1)."""


class FailureGuard:
    """Failure rate over the last ``window`` episodes; above ``max_rate`` the run stops.

    The rate is judged only once ``window`` episodes have finished, so one early crash does not
    stop a run. ``max_rate`` 1.0 never stops.
    """

    def __init__(self, max_rate: float, window: int) -> None:
        self.max_rate, self.window = max_rate, max(1, window)
        self._recent: deque[tuple[bool, str | None]] = deque(maxlen=self.window)
        self.failed_total = 0
        self.episodes_total = 0

    def record(self, trajectories: Iterable[Trajectory]) -> None:
        for t in trajectories:
            failed = t.status == Status.FAILED
            self._recent.append((failed, t.error if failed else None))
            self.failed_total += failed
            self.episodes_total += 1
        if len(self._recent) < self.window or self.max_rate >= 1.0:
            return
        rate = sum(f for f, _ in self._recent) / len(self._recent)
        if rate > self.max_rate:
            errors = [e for f, e in self._recent if f and e]
            common = max(set(errors), key=errors.count) if errors else "(no error text)"
            raise FailureRateExceeded(
                f"{rate:.0%} of the last {len(self._recent)} episodes failed, above trainer.max_failure_rate="
                f"{self.max_rate}; the most common error: {common}"
            )
