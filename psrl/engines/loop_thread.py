"""An asyncio event loop in its own thread, callable from anyio code on asyncio or trio.

vLLM's ``AsyncLLM`` needs asyncio and binds to the loop it first runs on. Giving it a loop of its
own lets callers run on any backend, lets one engine outlive many short-lived caller loops (a
test session, a CLI command), and keeps vLLM's output handling off the callers' loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import anyio
import sniffio

T = TypeVar("T")


def _threadsafe_call_soon() -> Callable[[Callable[[], object]], object]:
    """A function that schedules a callback on the calling task's event loop from any thread."""
    library = sniffio.current_async_library()
    if library == "asyncio":
        return asyncio.get_running_loop().call_soon_threadsafe
    if library == "trio":
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon
    raise RuntimeError(f"unsupported async library {library!r}: use asyncio or trio")


async def wait_future(future: concurrent.futures.Future[T]) -> T:
    """Wait for a future completed by another thread without blocking the caller's loop.

    If the caller is cancelled, the future is cancelled too: for a coroutine submitted with
    ``run_coroutine_threadsafe`` that cancels the task on its own loop.
    """
    if not future.done():
        event = anyio.Event()
        call_soon = _threadsafe_call_soon()

        def wake(_: object) -> None:
            try:
                call_soon(event.set)
            except RuntimeError:  # the waiting loop has finished; nobody is left to wake
                pass

        future.add_done_callback(wake)
        try:
            await event.wait()
        except BaseException:
            future.cancel()
            raise
    return future.result()


class LoopThread:
    """A daemon thread running an asyncio loop until ``stop()``."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.wait(pending, timeout=5.0))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if not self.alive:
            coro.close()
            raise RuntimeError(f"event loop thread {self._thread.name!r} has stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on this thread's loop and wait for it from the caller's (any backend)."""
        return await wait_future(self.submit(coro))

    def run_blocking(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on this thread's loop; for synchronous callers in other threads."""
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError("run_blocking called from the loop's own thread would deadlock")
        return self.submit(coro).result(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread.is_alive() and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)
        if not self.in_loop_thread():
            self._thread.join(timeout)
