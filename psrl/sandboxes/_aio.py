"""aiodocker speaks asyncio only. Under asyncio its calls run in place; under trio they run on a
private asyncio loop in a thread (an anyio blocking portal), one call = one whole operation."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import anyio
import sniffio
from anyio.from_thread import BlockingPortal

T = TypeVar("T")


class AsyncioCaller:
    def __init__(self) -> None:
        self._portal_cm: AbstractContextManager[BlockingPortal] | None = None
        self._portal: BlockingPortal | None = None
        self._mode: str | None = None  # "direct" or "portal", fixed by the first call

    def _use_portal(self) -> bool:
        if self._mode is None:
            self._mode = "direct" if sniffio.current_async_library() == "asyncio" else "portal"
        return self._mode == "portal"

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        if not self._use_portal():
            return await fn(*args)
        if self._portal is None:
            self._portal_cm = anyio.from_thread.start_blocking_portal("asyncio")
            self._portal = self._portal_cm.__enter__()
        fut = self._portal.start_task_soon(fn, *args)
        try:
            return await anyio.to_thread.run_sync(fut.result, abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            # Cancel the asyncio side too, and let its cleanup (killing an exec) finish first.
            fut.cancel()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(concurrent.futures.wait, [fut])
            raise

    async def aclose(self) -> None:
        cm, self._portal_cm, self._portal = self._portal_cm, None, None
        if cm is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(cm.__exit__, None, None, None)
