"""Where step metrics go: structlog, a JSONL file, TensorBoard, a rich progress bar, and at the
end a PNG of reward and validation reward against step."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from psrl.log import get_logger

Kind = Literal["train", "val"]
_SUMMARY_KEYS = ("reward/mean", "reward/pass_rate", "staleness/max", "throughput/samples_per_s", "train/loss")


class JsonlWriter:
    """One JSON object per line: ``{"kind": "train"|"val", "step": k, ...metrics}``. Appends, so
    a resumed run continues the same file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", buffering=1)

    def log(self, step: int, metrics: Mapping[str, float], *, kind: Kind) -> None:
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        self._fh.write(json.dumps({"kind": kind, "step": step, **clean}) + "\n")

    def close(self) -> None:
        self._fh.close()


class TensorBoardWriter:
    def __init__(self, logdir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(log_dir=str(logdir))

    def log(self, step: int, metrics: Mapping[str, float], *, kind: Kind) -> None:
        for k, v in metrics.items():
            tag = k if kind == "train" or k.startswith("val/") else f"val/{k}"
            self._w.add_scalar(tag, v, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class LogWriter:
    """A structlog line per step with the headline figures."""

    def __init__(self) -> None:
        self._log = get_logger("psrl.train")

    def log(self, step: int, metrics: Mapping[str, float], *, kind: Kind) -> None:
        prefix = "val/" if kind == "val" else ""
        fields = {k.replace("/", "_"): round(metrics[prefix + k], 4) for k in _SUMMARY_KEYS if prefix + k in metrics}
        self._log.info("validation" if kind == "val" else "step", step=step, **fields)

    def close(self) -> None:
        pass


class ProgressBar:
    """A rich progress bar: step, reward, validation reward, staleness, samples/s."""

    def __init__(self, total_steps: int, start_step: int = 0) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"), transient=False,
        )
        self._val = float("nan")
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
        self._progress.start()

    def log(self, step: int, metrics: Mapping[str, float], *, kind: Kind) -> None:
        if kind == "val":
            self._val = metrics.get("val/reward/mean", self._val)
            return
        info = (
            f"reward {metrics.get('reward/mean', float('nan')):.3f}  val {self._val:.3f}  "
            f"stale<={int(metrics.get('staleness/max', 0))}  {metrics.get('throughput/samples_per_s', 0):.2f} samples/s"
        )
        self._progress.update(self._task, completed=step, info=info)

    def close(self) -> None:
        self._progress.stop()


class MetricsFanout:
    """Sends every record to each writer; closes them all even if one fails."""

    def __init__(self, writers: Sequence[Any]) -> None:
        self.writers = list(writers)

    def log(self, step: int, metrics: Mapping[str, float], *, kind: Kind) -> None:
        for w in self.writers:
            w.log(step, metrics, kind=kind)

    def close(self) -> None:
        errors = []
        for w in self.writers:
            try:
                w.close()
            except Exception as e:  # noqa: BLE001 - close the rest, then report
                errors.append(e)
        if errors:
            raise errors[0]


class WithCounters:
    """Adds the counters ``counters()`` returns (e.g. the sandbox pool's ``sandbox/*``) to every
    train record before handing it to ``sink``."""

    def __init__(self, sink: Any, counters: Any) -> None:
        self.sink, self.counters = sink, counters

    def log(self, step: int, metrics: Mapping[str, float], *, kind: Kind) -> None:
        self.sink.log(step, {**metrics, **self.counters()} if kind == "train" else metrics, kind=kind)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_rewards(metrics_jsonl: str | Path, out_png: str | Path, *, title: str = "PSRL training") -> Path:
    """Reward (training batches) and validation reward against step, from the JSONL file. When a
    resumed run logged a step twice, the later record wins."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train: dict[int, float] = {}
    val: dict[int, float] = {}
    for rec in read_jsonl(metrics_jsonl):
        if rec["kind"] == "train" and rec.get("reward/mean") is not None:
            train[rec["step"]] = rec["reward/mean"]
        elif rec["kind"] == "val" and rec.get("val/reward/mean") is not None:
            val[rec["step"]] = rec["val/reward/mean"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        xs = sorted(train)
        ax.plot(xs, [train[x] for x in xs], label="reward (training batch)", color="tab:blue", alpha=0.7)
    if val:
        xs = sorted(val)
        ax.plot(xs, [val[x] for x in xs], "o-", label="validation reward", color="tab:red")
    ax.set_xlabel("step (policy version)")
    ax.set_ylabel("mean reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
