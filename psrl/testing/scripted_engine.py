"""A scripted inference engine: deterministic outputs for unit tests of loops and pipelines."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import anyio
import numpy as np

from psrl.engines.base import EngineCounters, EngineStatistics, FinishReason, GenerateRequest, GenerateResult

Script = Callable[[GenerateRequest], Sequence[int] | np.ndarray]


class ScriptedEngine:
    """Implements ``InferenceEngine``. ``script(request)`` returns the output ids.

    ``script`` may also be a list of outputs, served in order (then it repeats the last one).
    Every output token gets log-prob ``logprob`` and the current version. ``delay_s`` (or a
    callable of the request) simulates generation time; pause/resume and weight updates behave
    like the real engine: waiting requests continue after resume, and the version bumps.
    """

    def __init__(
        self,
        script: Script | Sequence[Sequence[int]],
        *,
        logprob: float = -0.5,
        delay_s: float | Callable[[GenerateRequest], float] = 0.0,
        vocab_size: int | None = None,
    ) -> None:
        if callable(script):
            self._script: Script = script
        else:
            outputs = [np.asarray(o, np.int32) for o in script]
            counter = iter(range(1 << 62))
            self._script = lambda req: outputs[min(next(counter), len(outputs) - 1)]
        self._logprob = np.float32(logprob)
        self._delay = delay_s
        self._vocab_size = vocab_size
        self.version = 0
        self.requests: list[GenerateRequest] = []  # every request seen, for assertions
        self._resumed = anyio.Event()
        self._resumed.set()
        self._in_flight: dict[str, anyio.CancelScope] = {}
        self._aborted: set[str] = set()
        self._counters = EngineCounters()
        self._closed = False

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self._closed:
            return GenerateResult.failed(request.request_id, "engine is closed")
        if request.sampling.max_tokens < 1:
            return GenerateResult.failed(request.request_id, f"max_tokens must be >= 1, got {request.sampling.max_tokens}")
        if self._vocab_size is not None and len(request.prompt_ids) and (
            request.prompt_ids.min() < 0 or request.prompt_ids.max() >= self._vocab_size
        ):
            return GenerateResult.failed(request.request_id, f"prompt has token ids outside [0, {self._vocab_size})")
        self.requests.append(request)
        await self._resumed.wait()
        out = np.asarray(self._script(request), np.int32)
        finish = FinishReason.STOP
        if len(out) > request.sampling.max_tokens:
            out, finish = out[: request.sampling.max_tokens], FinishReason.LENGTH
        with anyio.CancelScope() as scope:
            self._in_flight[request.request_id] = scope
            try:
                delay = self._delay(request) if callable(self._delay) else self._delay
                if delay:
                    await anyio.sleep(delay)
                await self._resumed.wait()
            finally:
                del self._in_flight[request.request_id]
        if scope.cancelled_caught or request.request_id in self._aborted:
            self._aborted.discard(request.request_id)
            out, finish = out[:0], FinishReason.ABORT
        self._counters.count_result(len(out))
        return GenerateResult(
            request.request_id,
            out,
            np.full(len(out), self._logprob, np.float32),
            np.full(len(out), self.version, np.int32),
            finish,
        )

    async def abort(self, request_id: str) -> None:
        scope = self._in_flight.get(request_id)
        if scope is not None:
            self._aborted.add(request_id)
            scope.cancel()

    async def pause(self) -> None:
        if self._resumed.is_set():
            self._resumed = anyio.Event()

    async def resume(self) -> None:
        self._resumed.set()

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        start = anyio.current_time()
        was_paused = not self._resumed.is_set()  # a caller's pause outlasts the update, as in vLLM
        await self.pause()
        for _ in named_tensors:
            pass
        self.version = version
        if not was_paused:
            await self.resume()
        self._counters.count_update(anyio.current_time() - start)

    def statistics(self) -> EngineStatistics:
        return self._counters.statistics(
            version=self.version, requests_in_flight=len(self._in_flight), paused=not self._resumed.is_set()
        )

    async def aclose(self) -> None:
        self._closed = True
        for scope in list(self._in_flight.values()):
            scope.cancel()
        self._resumed.set()
