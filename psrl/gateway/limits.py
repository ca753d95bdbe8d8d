"""Input limits and the worker threads that keep heavy text work off the event loop.

Each check raises a :class:`GatewayError` whose status and OpenAI-style body say what was wrong:
413 for a body over the limit, 408 for a body that does not arrive in time, 404 for a model that
is not served, 400 for token ids outside the vocabulary and for a prompt longer than the engine
can take.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import anyio
import numpy as np

from .wire import GatewayError

T = TypeVar("T")


async def read_body(
    chunks: AsyncIterator[bytes], content_length: str | None, *, max_bytes: int, timeout_s: float
) -> bytes:
    """The whole body, refused unread (413) when its declared or actual size passes ``max_bytes``."""
    if content_length is not None:
        try:
            declared = int(content_length)
        except ValueError:
            raise GatewayError(400, f"Content-Length {content_length!r} is not a number") from None
        if declared > max_bytes:
            raise _too_large(declared, max_bytes)
    parts: list[bytes] = []
    size = 0
    with anyio.move_on_after(timeout_s) as scope:
        async for chunk in chunks:
            size += len(chunk)
            if size > max_bytes:  # chunked bodies declare no length: stop reading at the limit
                raise _too_large(size, max_bytes)
            parts.append(chunk)
    if scope.cancelled_caught:
        raise GatewayError(408, f"the request body did not arrive within {timeout_s:g} s", "timeout_error")
    return b"".join(parts)


def _too_large(size: int, max_bytes: int) -> GatewayError:
    return GatewayError(
        413, f"request body of {size} bytes or more is over this gateway's limit of {max_bytes} bytes "
        "(gateway.max_body_bytes)", "invalid_request_error",
    )  # fmt: skip


def check_model(name: str | None, served: str, aliases: Sequence[str]) -> None:
    if name is None or name == served or name in aliases:
        return
    known = ", ".join(repr(n) for n in (served, *aliases))
    raise GatewayError(404, f"The model {name!r} does not exist; this gateway serves {known}", "not_found_error", param="model")


def prompt_ids(ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """Token ids from a request as int32, each checked against the vocabulary (JSON integers have
    no bound, and numpy would wrap or overflow on ids past int32)."""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise GatewayError(
                400, f"prompt[{i}] = {t} is not a token id of this model (valid ids: 0 to {vocab_size - 1})",
                "invalid_request_error", param="prompt",
            )  # fmt: skip
    return np.asarray(ids, np.int32)


def check_prompt_length(n: int, max_model_len: int | None, param: str) -> None:
    if max_model_len is not None and n >= max_model_len:
        raise GatewayError(
            400, f"This model's maximum context length is {max_model_len} tokens, but the prompt has {n} "
            "tokens: no room to generate", "invalid_request_error", param=param,
        )  # fmt: skip


class Offload:
    """Runs text work (JSON parsing, chat templating, tokenization, detokenization) in a bounded
    pool of worker threads when its input is large, inline when it is small (a thread hop costs
    more than templating a short chat: the p99 of ``psrl bench gateway``)."""

    def __init__(self, workers: int, min_chars: int) -> None:
        self.workers, self.min_chars = workers, min_chars
        self._limiter: anyio.CapacityLimiter | None = None

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        if size < self.min_chars:
            return fn(*args)
        if self._limiter is None:  # made lazily: it belongs to the running event loop
            self._limiter = anyio.CapacityLimiter(self.workers)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
