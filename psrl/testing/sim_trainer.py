"""A SIMULATED trainer whose step time follows a ``LatencyModel`` (it learns nothing).

It implements the pipeline's ``PolicyTrainer``: ``train_step`` blocks for the modelled time (the
pipeline runs it in a worker thread, as it does the real one), checks the batch it was given, and
checkpoints its step counter.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from psrl.trajectory import list_column_to_numpy

from .latency_model import LatencyModel
from .sim_engine import SharedCores


class SimulatedTrainer:
    fields = ("prompt_ids", "response_ids", "loss_mask", "logprobs", "versions", "reward", "group_id")

    def __init__(self, model: LatencyModel, *, cores: SharedCores | None = None, slices: int = 20) -> None:
        self.model = model
        self.cores = cores or SharedCores()
        self.slices = slices
        self.steps = 0
        self.samples_seen = 0

    def train_step(self, batch: pa.RecordBatch) -> Mapping[str, float]:
        missing = [f for f in self.fields if f not in batch.schema.names]
        if missing:
            raise KeyError(f"SimulatedTrainer: batch lacks columns {missing}")
        tokens = sum(len(a) for a in list_column_to_numpy(batch.column("prompt_ids")))
        tokens += sum(len(a) for a in list_column_to_numpy(batch.column("response_ids")))
        # In slices, each slowed while the engine works on shared cores (``LatencyModel.contention``).
        slices = self.slices if self.model.shared_hardware else 1
        piece = (self.model.train_s(tokens) + self.model.step_overhead_s) * self.model.time_scale / slices
        self.cores.trainer_busy = True
        try:
            deadline = time.perf_counter()
            for _ in range(slices):  # to deadlines, so a loaded machine's late wake-ups do not add up
                deadline += piece * self.model.overlap_factor(self.cores.engine_active > 0)
                delay = deadline - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
        finally:
            self.cores.trainer_busy = False
        self.steps += 1
        self.samples_seen += batch.num_rows
        return {"loss": float(np.exp(-self.steps / 10)), "tokens": float(tokens), "simulated": 1.0}

    def named_tensors(self) -> Iterable[tuple[str, Any]]:
        return [("simulated.step", np.array([self.steps], np.int64))]

    def save_checkpoint(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "sim_trainer.json").write_text(json.dumps({"steps": self.steps, "samples_seen": self.samples_seen}))

    def load_checkpoint(self, path: str) -> None:
        state = json.loads((Path(path) / "sim_trainer.json").read_text())
        self.steps, self.samples_seen = int(state["steps"]), int(state["samples_seen"])
