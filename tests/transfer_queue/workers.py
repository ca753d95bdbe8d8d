"""Process entry points for the multi-process tests (importable, so spawn can find them)."""

from __future__ import annotations

import anyio

from psrl.testing.conformance_queue import make_trajectory
from psrl.trajectory import to_arrow
from psrl.transfer_queue import QueueHandle

TOKENS = ["key", "group_id", "prompt_ids", "response_ids", "loss_mask", "logprobs", "versions"]


def produce(handle: QueueHandle, producers: int, per_producer: int, backend: str) -> None:
    """``producers`` concurrent tasks; producer p puts keys p-0 .. p-(n-1): half as whole
    trajectories, half as tokens first and the reward later (field-level readiness)."""

    async def one(q, p: int) -> None:
        for i in range(per_producer):
            key = f"p{p}-{i}"
            t = make_trajectory(key, f"g{p}-{i // 2}", length=8 + (p + i) % 13, reward=float(p * 1000 + i))
            if i % 2:
                await q.batch_put(to_arrow([t], TOKENS), partition="train")
                await q.put_fields([key], {"reward": [t.reward]}, partition="train")
            else:
                await q.put(t, partition="train")

    async def main() -> None:
        async with handle.connect() as q, anyio.create_task_group() as tg:
            for p in range(producers):
                tg.start_soon(one, q, p)

    anyio.run(main, backend=backend)
