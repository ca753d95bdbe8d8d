"""An ``InferenceEngine`` wrapper that measures how long the engine was busy generating.

"Busy" is wall time with at least one request in flight; it is what the pipeline reports as
generation time per step (summing request durations would count concurrent requests many times).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from psrl.engines import EngineStatistics, GenerateRequest, GenerateResult, InferenceEngine


class TimedEngine:
    def __init__(self, engine: InferenceEngine, clock=time.perf_counter) -> None:
        self.inner = engine
        self._clock = clock
        self._in_flight = 0
        self._busy_since = 0.0
        self._busy_total = 0.0
        self.tokens = 0
        self.failed_requests = 0

    def busy_seconds(self) -> float:
        extra = self._clock() - self._busy_since if self._in_flight else 0.0
        return self._busy_total + extra

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self._in_flight == 0:
            self._busy_since = self._clock()
        self._in_flight += 1
        try:
            result = await self.inner.generate(request)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._busy_total += self._clock() - self._busy_since
        self.tokens += len(result.output_ids)
        self.failed_requests += result.finish_reason == "error"
        return result

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def pause(self) -> None:
        await self.inner.pause()

    async def resume(self) -> None:
        await self.inner.resume()

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        await self.inner.update_weights(named_tensors, version)

    def statistics(self) -> EngineStatistics:
        return self.inner.statistics()

    async def aclose(self) -> None:
        await self.inner.aclose()
