"""One request's side of a vLLM replica: what is wrong with it, and what it has generated so far.

``VLLMEngine`` serves a request as one or more segments (see ``vllm_engine``); this module holds
what does not depend on the engine's pause state: checking a request against the served model,
reading one segment's output stream from vLLM into the request's tokens, log-probs and per-token
versions, and turning those into a ``GenerateResult``. It never imports vLLM.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .base import FinishReason, GenerateRequest, GenerateResult
from .vllm_args import sampled_logprobs

FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


@dataclass
class ActiveRequest:
    segment_id: str | None = None
    user_aborted: bool = False


@dataclass
class PartialOutput:
    """A request's tokens so far, over all its segments."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    first_token_s: float | None = None

    def result(self, request_id: str, finish: FinishReason, error: str | None = None, stop: Any = None) -> GenerateResult:
        return GenerateResult(
            request_id,
            np.asarray(self.ids, np.int32),
            np.asarray(self.logprobs, np.float32),
            np.asarray(self.versions, np.int32),
            finish,
            error,
            stop,
            self.first_token_s,
        )

    def extend_versions(self, start: int, spans: Any, fallback: int) -> None:
        """Version each token from ``start`` on by vLLM's weight-version ``spans``; ``fallback``
        where a span does not say (none came, or a label not set by us)."""
        versions = [fallback] * (len(self.ids) - start)
        for span in spans or ():
            try:
                v = int(span.version)
            except ValueError:  # a label not set by us (vLLM's "default")
                v = fallback
            for i in range(span.start, min(span.end, len(versions))):
                versions[i] = v
        self.versions.extend(versions)


async def read_segment(
    stream: AsyncIterator[Any], out: PartialOutput, active: ActiveRequest, submitted: float
) -> tuple[Any, Any, Any]:
    """Read one segment's delta outputs into ``out``; returns vLLM's finish reason, stop reason
    and weight-version spans (``"abort"`` and no spans if the caller aborted meanwhile)."""
    finish = stop = spans = None
    async with contextlib.aclosing(stream):
        async for step in stream:
            c = step.outputs[0]
            if out.first_token_s is None and c.token_ids:
                out.first_token_s = time.perf_counter() - submitted
            out.ids.extend(c.token_ids)
            out.logprobs.extend(sampled_logprobs(list(c.token_ids), c.logprobs))
            if step.finished:
                finish, stop, spans = c.finish_reason, c.stop_reason, c.weight_versions
            elif active.user_aborted:  # the abort raced the segment's submission
                finish = "abort"
                break  # closing the stream aborts the request in vLLM
    return finish, stop, spans


def request_problem(req: GenerateRequest, max_model_len: int, vocab_size: int) -> str | None:
    """What is wrong with a request for a model of ``max_model_len`` and ``vocab_size``, in
    words, or None."""
    ids = req.prompt_ids
    if ids.ndim != 1:
        return f"prompt_ids must be one-dimensional, got shape {ids.shape}"
    if len(ids) == 0:
        return "prompt is empty"
    if len(ids) >= max_model_len:
        return f"prompt has {len(ids)} tokens but max_model_len is {max_model_len}: no room to generate"
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if len(bad):
        return (
            f"prompt has token ids outside the vocabulary [0, {vocab_size}): "
            f"{ids[bad[0]]} at position {bad[0]} ({len(bad)} such ids)"
        )
    if req.sampling.max_tokens < 1:
        return f"max_tokens must be >= 1, got {req.sampling.max_tokens}"
    return None
