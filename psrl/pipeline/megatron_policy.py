"""The pipeline's ``PolicyTrainer`` over ``psrl.trainer.MegatronTrainer``.

The weights to publish are exported in the same worker thread as the step (a Megatron -> HF
gather on the trainer's own thread), so the event loop only hands them to the engines.
``publish_weights`` streams them from this process straight into the engines' workers
(``psrl.trainer.weight_sync.DirectPublisher``). Once a version was sent, each export writes into
the sender's shared-memory export buffers (``export_target``), so on one machine the weights are
cast once, where the engines read them, and not copied again to be sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa

from psrl.config.weight_sync import WeightSyncConfig
from psrl.trainer.batch import TRAINER_FIELDS


class MegatronPolicy:
    fields = TRAINER_FIELDS

    def __init__(self, trainer: Any, weight_sync: WeightSyncConfig | None = None) -> None:
        self.trainer = trainer  # a psrl.trainer.MegatronTrainer
        self.weight_sync = weight_sync or WeightSyncConfig()
        self._weights: list[tuple[str, Any]] = []
        self._publisher: Any = None
        # Whoever sends the weights (a DirectPublisher, a Ray trainer rank's WeightSender): its
        # ``export_buffers()`` are the tensors the next export writes into (None: new tensors).
        self.export_target: Any = None
        self.last_sync: Any = None  # the SyncReport of the last publish_weights

    def train_step(self, batch: pa.RecordBatch) -> Mapping[str, float]:
        metrics = self.trainer.step(batch)
        self._weights = self.export_weights()
        return metrics

    def export_weights(self) -> list[tuple[str, Any]]:
        into = self.export_target.export_buffers() if self.export_target is not None else None
        return list(self.trainer.hf_weights(self.trainer.sync_dtype(), into=into))

    def named_tensors(self) -> Iterable[tuple[str, Any]]:
        """The current weights (those exported by the last step, else exported now). Once an
        ``export_target`` gives buffers, these are its buffers: valid until the next export."""
        weights, self._weights = self._weights, []
        return weights or self.export_weights()

    async def publish_weights(self, engine: Any, version: int) -> None:
        """Stream the current weights into ``engine`` as ``version`` (retried as configured)."""
        import anyio

        from psrl.trainer.weight_sync import DirectPublisher

        if self._publisher is None or self._publisher.engine is not engine:
            if self._publisher is not None:
                await self._publisher.aclose()
            self._publisher = DirectPublisher(engine, self.weight_sync)
            self.export_target = self._publisher
        weights = await anyio.to_thread.run_sync(self.named_tensors)
        self.last_sync = await self._publisher.publish(weights, version, adapter=self.trainer.adapter_config())

    async def aclose_publisher(self) -> None:
        if self._publisher is not None:
            publisher, self._publisher = self._publisher, None
            self.export_target = None
            await publisher.aclose()

    def save_checkpoint(self, path: str) -> None:
        self.trainer.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.trainer.load_checkpoint(path)
