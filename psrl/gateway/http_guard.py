"""A deadline on request heads, so slow or stalled clients (slow-loris) cannot hold connections.

uvicorn arms its keep-alive timer only after a response; a client that connects and then sends
its request head a byte at a time (or never) would keep the connection, its buffers and a slot
of the accept backlog forever. The guard checks each connection every ``timeout_s``: one that
started no new request since the previous check, and has none in progress, is closed. A head
therefore gets between one and two periods to arrive. Bodies have their own deadline in the app
(``read_body``).
"""

from __future__ import annotations

import asyncio
from typing import Any


def guarded(protocol_cls: type[asyncio.Protocol], timeout_s: float) -> type[asyncio.Protocol]:
    """A subclass of uvicorn's HTTP protocol class (h11 or httptools) with the head deadline."""

    class Guarded(protocol_cls):  # type: ignore[valid-type, misc]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._guard_seen: object = self.cycle
            self._guard = self.loop.call_later(timeout_s, self._guard_check)

        def _guard_check(self) -> None:
            cycle = self.cycle
            busy = cycle is not None and not cycle.response_complete
            if not busy and cycle is self._guard_seen:
                if not self.transport.is_closing():
                    self.transport.close()
                return
            self._guard_seen = cycle
            self._guard = self.loop.call_later(timeout_s, self._guard_check)

        def connection_lost(self, exc: Exception | None) -> None:
            self._guard.cancel()
            super().connection_lost(exc)

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{protocol_cls.__name__}"
    return Guarded
