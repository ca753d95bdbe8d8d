"""A SIMULATED inference engine whose timings follow a ``LatencyModel``.

It implements ``InferenceEngine`` like the real one: requests take engine slots, tokens come out
in chunks, ``pause`` holds them, ``update_weights`` pauses, bumps the version and resumes, and a
request in flight across an update carries both versions in its per-token ``versions``. As
``VLLMEngine`` does (it aborts and resubmits), a request held by a pause prefills its prompt and
tokens so far again on resume (``LatencyModel.resume_prefill``). Prefill and decode are both
engine work: slowed by saturation and by a busy trainer on shared cores.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import anyio
import numpy as np

from psrl.engines.base import EngineCounters, EngineStatistics, FinishReason, GenerateRequest, GenerateResult

from .latency_model import LatencyModel


class SharedCores:
    """Who is busy on the cores a simulated engine and trainer share (``LatencyModel.shared_hardware``):
    each slows down by ``contention`` while the other works. Plain counters: the trainer reads them
    from its worker thread, where a stale read only shifts a slice of time."""

    def __init__(self) -> None:
        self.trainer_busy = False
        self.engine_active = 0


class SimulatedEngine:
    def __init__(
        self, model: LatencyModel, *, seed: int = 0, chunk_tokens: int = 64, vocab_size: int = 256,
        cores: SharedCores | None = None,
    ) -> None:
        self.model = model
        self.cores = cores or SharedCores()
        self._rng = np.random.default_rng(seed)
        # A saturating engine's speed follows how many requests decode at once: short chunks
        # let each request see that number change.
        self._chunk = min(chunk_tokens, 8) if model.engine_saturation > 0 else chunk_tokens
        self._vocab = vocab_size
        self._slots = anyio.CapacityLimiter(model.engine_slots)
        self._resumed = anyio.Event()
        self._resumed.set()
        self._epoch = 0  # bumped by every pause
        self._in_flight: dict[str, anyio.CancelScope] = {}
        self.version = 0
        self._counters = EngineCounters()
        self._closed = False

    def _sleep(self, sim_s: float):
        return anyio.sleep(sim_s * self.model.time_scale)

    async def _work(self, sim_s: float, slices: int = 1) -> None:
        """``sim_s`` of engine work at full speed, in ``slices`` that each see how many requests
        work at once."""
        for _ in range(slices):
            self.cores.engine_active += 1
            try:
                slower = self.model.overlap_factor(self.cores.trainer_busy) * self.model.saturation_factor(self.cores.engine_active)
                await self._sleep(sim_s / slices * slower)
            finally:
                self.cores.engine_active -= 1

    async def _prefill(self, tokens: int) -> None:
        await self._work(self.model.prefill_s_per_token * tokens, 8 if self.model.engine_saturation > 0 else 1)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self._closed:
            return GenerateResult.failed(request.request_id, "engine is closed")
        if request.sampling.max_tokens < 1:
            return GenerateResult.failed(request.request_id, f"max_tokens must be >= 1, got {request.sampling.max_tokens}")
        total = self.model.draw_tokens(self._rng, request.sampling.max_tokens)
        ids = self._rng.integers(0, self._vocab, total).astype(np.int32)
        versions = np.zeros(total, np.int32)
        produced, first_token_s = 0, None
        prompt = len(request.prompt_ids)
        with anyio.CancelScope() as scope:
            self._in_flight[request.request_id] = scope
            try:
                async with self._slots:
                    await self._resumed.wait()
                    epoch, start = self._epoch, anyio.current_time()
                    await self._prefill(prompt)
                    first_token_s = anyio.current_time() - start
                    while produced < total:
                        await self._resumed.wait()
                        if self._epoch != epoch:  # held by a pause: resubmitted, its KV recomputed
                            epoch = self._epoch
                            if self.model.resume_prefill:
                                await self._prefill(prompt + produced)
                        k = min(self._chunk, total - produced)
                        version = self.version
                        await self._work(self.model.decode_s_per_token * k)
                        versions[produced : produced + k] = version
                        produced += k
            finally:
                del self._in_flight[request.request_id]
        finish = FinishReason.ABORT if scope.cancelled_caught else (
            FinishReason.LENGTH if total == request.sampling.max_tokens else FinishReason.STOP
        )
        self._counters.count_result(produced)
        return GenerateResult(
            request.request_id, ids[:produced], np.full(produced, -1.0, np.float32), versions[:produced], finish,
            first_token_s=first_token_s,
        )

    async def abort(self, request_id: str) -> None:
        scope = self._in_flight.get(request_id)
        if scope is not None:
            scope.cancel()

    async def pause(self) -> None:
        if self._resumed.is_set():
            self._resumed = anyio.Event()
            self._epoch += 1
            if self._in_flight:  # stopping running requests takes time; an idle engine pauses at once
                await self._sleep(self.model.pause_s + self.model.pause_s_per_request * len(self._in_flight))

    async def resume(self) -> None:
        self._resumed.set()

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        start = anyio.current_time()
        was_paused = not self._resumed.is_set()
        await self.pause()
        for _ in named_tensors:
            pass
        await self._sleep(self.model.weight_sync_s)
        self.version = version
        if not was_paused:
            await self.resume()
        self._counters.count_update(anyio.current_time() - start)

    def statistics(self) -> EngineStatistics:
        return self._counters.statistics(
            version=self.version, requests_in_flight=len(self._in_flight), paused=not self._resumed.is_set(),
            extra={"simulated": True},
        )

    async def aclose(self) -> None:
        self._closed = True
        for scope in list(self._in_flight.values()):
            scope.cancel()
        self._resumed.set()
