"""The pipeline's ``PolicyTrainer`` over ``psrl.trainer.MegatronTrainer``.

The weights to publish are exported in the same worker thread as the step (a Megatron -> HF
gather on the trainer's own thread), so the event loop only hands them to the engines.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa

from psrl.trainer.batch import TRAINER_FIELDS


class MegatronPolicy:
    fields = TRAINER_FIELDS

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer  # a psrl.trainer.MegatronTrainer
        self._weights: list[tuple[str, Any]] = []

    def train_step(self, batch: pa.RecordBatch) -> Mapping[str, float]:
        metrics = self.trainer.step(batch)
        self._weights = self.export_weights()
        return metrics

    def export_weights(self) -> list[tuple[str, Any]]:
        return list(self.trainer.hf_weights(self.trainer.sync_dtype()))

    def named_tensors(self) -> Iterable[tuple[str, Any]]:
        """The current weights (those exported by the last step, else exported now)."""
        weights, self._weights = self._weights, []
        return weights or self.export_weights()

    def save_checkpoint(self, path: str) -> None:
        self.trainer.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.trainer.load_checkpoint(path)
