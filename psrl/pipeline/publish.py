"""Publishing a trainer's weights to the engines, the way the trainer supports.

A trainer with ``publish_weights(engine, version)`` streams them from its own ranks straight into
the engines' workers (``MegatronPolicy``, ``RayPolicyTrainer``): the caller, the driver, passes
only metadata. Any other ``PolicyTrainer`` hands its ``named_tensors()`` to
``engine.update_weights``.
"""

from __future__ import annotations

from typing import Any

import anyio


async def publish_weights(trainer: Any, engine: Any, version: int) -> None:
    # A TimedEngine wraps the Router only to time generation: syncs go to the Router itself.
    engine = getattr(engine, "inner", engine)
    direct = getattr(trainer, "publish_weights", None)
    if direct is not None:
        await direct(engine, version)
        return
    weights = await anyio.to_thread.run_sync(trainer.named_tensors)
    await engine.update_weights(weights, version)
