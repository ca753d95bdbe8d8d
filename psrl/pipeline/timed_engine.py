"""An ``InferenceEngine`` wrapper that measures how long the engine was busy generating.

"Busy" is wall time with at least one request in flight; it is what the pipeline reports as
generation time per step (summing request durations would count concurrent requests many times).
It also keeps each finished request's duration, output length, prompt length and, where the
engine measures it, time to first token (the prompt's prefill) until ``take_requests``, so every
step's metrics carry what the pipeline model (``psrl bench pipeline --calibrate``) fits.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any, NamedTuple

from psrl.engines import EngineStatistics, GenerateRequest, GenerateResult, InferenceEngine


class RequestTiming(NamedTuple):
    seconds: float
    output_tokens: int
    prompt_tokens: int
    first_token_s: float | None  # None: the engine does not measure it


class TimedEngine:
    def __init__(self, engine: InferenceEngine, clock=time.perf_counter) -> None:
        self.inner = engine
        self._clock = clock
        self._in_flight = 0
        self._busy_since = 0.0
        self._busy_total = 0.0
        self.tokens = 0
        self.failed_requests = 0
        self._requests: list[RequestTiming] = []  # since take_requests
        self._peak_in_flight = 0

    def take_requests(self) -> tuple[list[RequestTiming], int]:
        """The timing of every request finished since the last call, and the most requests in
        flight at once meanwhile; starts a new window."""
        done, peak = self._requests, self._peak_in_flight
        self._requests, self._peak_in_flight = [], self._in_flight
        return done, peak

    def busy_seconds(self) -> float:
        extra = self._clock() - self._busy_since if self._in_flight else 0.0
        return self._busy_total + extra

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self._in_flight == 0:
            self._busy_since = self._clock()
        self._in_flight += 1
        self._peak_in_flight = max(self._peak_in_flight, self._in_flight)
        start = self._clock()
        try:
            result = await self.inner.generate(request)
        finally:
            self._in_flight -= 1
            end = self._clock()
            if self._in_flight == 0:
                self._busy_total += end - self._busy_since
        if result.finish_reason != "error":
            self._requests.append(
                RequestTiming(end - start, len(result.output_ids), len(request.prompt_ids), result.first_token_s)
            )
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


def request_metrics(requests: list[RequestTiming], peak_in_flight: int) -> dict[str, float]:
    """Per-request generation time and length of one step's window, as step metrics (``gen/``);
    ``gen/first_token_s_mean`` and ``gen/prompt_tokens_mean`` only when every request measured
    its time to first token."""
    if not requests:
        return {"gen/requests": 0.0, "gen/concurrency_max": float(peak_in_flight)}
    secs = [r.seconds for r in requests]
    toks = [r.output_tokens for r in requests]
    logs = [math.log(max(t, 1)) for t in toks]
    mean_log = sum(logs) / len(logs)
    prefill: dict[str, float] = {}
    if all(r.first_token_s is not None for r in requests):
        prefill = {
            "gen/first_token_s_mean": sum(r.first_token_s for r in requests) / len(requests),  # type: ignore[misc]
            "gen/prompt_tokens_mean": sum(r.prompt_tokens for r in requests) / len(requests),
        }
    return {
        "gen/requests": float(len(requests)),
        "gen/request_s_mean": sum(secs) / len(secs),
        "gen/request_s_max": max(secs),
        "gen/tokens_mean": sum(toks) / len(toks),
        "gen/tokens_max": float(max(toks)),
        "gen/log_tokens_mean": mean_log,
        "gen/log_tokens_var": sum((x - mean_log) ** 2 for x in logs) / len(logs),
        "gen/s_per_token": sum(secs) / max(sum(toks), 1),
        "gen/concurrency_max": float(peak_in_flight),
        **prefill,
    }
