"""The inference-engine seam: what agent loops and the gateway generate through."""

from __future__ import annotations

import enum
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: bool = True


@dataclass
class GenerateRequest:
    prompt_ids: np.ndarray  # int32
    sampling: SamplingParams = SamplingParams()
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    session_id: str | None = None  # requests of one session stick to one replica

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, np.int32)


@dataclass
class GenerateResult:
    request_id: str
    output_ids: np.ndarray  # int32
    logprobs: np.ndarray  # float32, one per output token
    versions: np.ndarray  # int32, policy version that produced each output token
    finish_reason: FinishReason
    error: str | None = None  # set when finish_reason is ERROR
    stop_reason: int | str | None = None  # the stop token or string that ended it, if any
    # seconds from submission to the first output token (the prompt's prefill); None: not measured
    first_token_s: float | None = None

    @classmethod
    def failed(cls, request_id: str, message: str) -> GenerateResult:
        empty_i = np.zeros(0, np.int32)
        return cls(request_id, empty_i, np.zeros(0, np.float32), empty_i.copy(), FinishReason.ERROR, message)


@dataclass(frozen=True)
class EngineStatistics:
    version: int
    requests_in_flight: int
    requests_done: int
    tokens_generated: int
    weight_updates: int
    last_update_s: float
    total_update_s: float
    paused: bool
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineCounters:
    """The running totals every engine reports through ``statistics()``."""

    requests_done: int = 0
    tokens_generated: int = 0
    weight_updates: int = 0
    last_update_s: float = 0.0
    total_update_s: float = 0.0

    def count_result(self, tokens: int) -> None:
        self.requests_done += 1
        self.tokens_generated += tokens

    def count_update(self, seconds: float) -> None:
        self.weight_updates += 1
        self.last_update_s = seconds
        self.total_update_s += seconds

    def statistics(
        self, *, version: int, requests_in_flight: int, paused: bool, extra: dict[str, Any] | None = None
    ) -> EngineStatistics:
        return EngineStatistics(
            version=version,
            requests_in_flight=requests_in_flight,
            requests_done=self.requests_done,
            tokens_generated=self.tokens_generated,
            weight_updates=self.weight_updates,
            last_update_s=self.last_update_s,
            total_update_s=self.total_update_s,
            paused=paused,
            extra=extra or {},
        )


@runtime_checkable
class InferenceEngine(Protocol):
    """Token-in, token-out generation with log-probs and policy versions.

    ``generate`` never raises for a bad request: the result has finish reason ERROR and a message.
    While paused, new and in-flight requests wait; ``update_weights`` pauses, loads, bumps the
    version and resumes, and requests that were in flight continue with the new weights.
    """

    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    async def abort(self, request_id: str) -> None: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None: ...

    def statistics(self) -> EngineStatistics: ...

    async def aclose(self) -> None: ...
