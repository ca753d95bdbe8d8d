"""Every blocking trainer call of a run (train steps, checkpoint saves) on one OS thread.

glibc gives each thread its own malloc arena, and the memory a step frees stays in the arena of
the thread that freed it. A CPU step allocates gigabytes of activations; run on whichever of
anyio's worker threads is free (they change from step to step while agent loops use them too),
each step could fill another arena: the driver of a ReTool run on SmolLM2 grew from 7 to 15 GB
RSS in four steps and was then OOM-killed. On one thread the next step reuses what the last freed.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

from psrl.engines.loop_thread import wait_future

T = TypeVar("T")


class TrainerThread:
    def __init__(self, name: str = "psrl-trainer") -> None:
        # The worker thread exits when this object is garbage collected (ThreadPoolExecutor's
        # own weak reference), so no close is needed.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the trainer thread, awaited from any anyio backend. Callers that must not
        abandon a started call shield it (the scheduler does)."""
        return await wait_future(self._pool.submit(fn))
