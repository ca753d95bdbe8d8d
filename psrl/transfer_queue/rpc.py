"""Request/reply over ZeroMQ: many requests in flight on one DEALER, a ROUTER per service.

A client request either gets its reply, or a ``ServiceUnavailable`` naming the service, its
endpoint and the keys concerned once ``timeout_s`` (plus any server-side wait the request asked
for) has passed: a dead peer never hangs a caller. A reply that arrives after its caller gave up
(cancelled or timed out) goes to the request's ``on_orphan`` hook, which can undo its effect
(hand back a batch, release a reservation), so giving up loses no samples.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import zmq
import zmq.auth.thread

from .errors import ServiceUnavailable, WouldBlock, remote_error
from .messages import Body, Cancel, Failed, decode, encode, failed
from .zsocket import AsyncSocket, CurveKeys, make_socket

log = logging.getLogger(__name__)

Reply = tuple[Body, Sequence]
Handler = Callable[[Body, list], "Reply | Awaitable[Reply]"]
OrphanHook = Callable[[Body], Body | None]

_ORPHAN_TTL_S = 600.0
NO_REPLY = 0  # request id of a notification: no reply is sent (call ids start at 1)


@dataclass
class _Waiter:
    event: anyio.Event = field(default_factory=anyio.Event)
    reply: tuple[Body, list] | None = None


class RpcClient:
    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        *,
        service: str,
        timeout_s: float,
        curve: CurveKeys | None = None,
        unavailable: type[ServiceUnavailable] = ServiceUnavailable,
    ):
        self.endpoint, self.service, self.timeout_s = endpoint, service, timeout_s
        self._unavailable = unavailable
        sock = make_socket(ctx, zmq.DEALER, curve=curve)
        sock.connect(endpoint)
        self._sock = AsyncSocket(sock)
        self._ids = itertools.count(1)
        self._pending: dict[int, _Waiter] = {}
        self._orphans: dict[int, tuple[float, OrphanHook]] = {}
        self.unconfirmed = 0  # notifications sent since the last reply to a ``call``

    async def call(
        self,
        body: Body,
        frames: Sequence = (),
        *,
        keys: Sequence[str] = (),
        wait_s: float = 0.0,
        what: str = "",
        on_orphan: OrphanHook | None = None,
    ) -> tuple[Body, list]:
        """Send ``body`` (+ buffer frames) and return the reply body and its frames.

        Raises ``WouldBlock`` or ``RemoteError`` when the service refused, and ``ServiceUnavailable``
        when it did not answer within ``timeout_s + wait_s``.
        """
        rid = next(self._ids)
        waiter = _Waiter()
        self._pending[rid] = waiter
        unconfirmed = self.unconfirmed
        limit = self.timeout_s + wait_s
        try:
            with anyio.move_on_after(limit):
                await self._sock.send([encode(rid, body), *frames])
                await waiter.event.wait()
        finally:
            if self._pending.pop(rid, None) is not None:
                if wait_s > 0:  # stop the server-side wait; ordered before our next request
                    self.notify(Cancel(rid))
                if on_orphan is not None:  # its reply may already be on the way
                    self._orphans[rid] = (time.monotonic(), on_orphan)
        if waiter.reply is None:
            raise self._unavailable(self.service, self.endpoint, limit, keys, what or type(body).__name__)
        self.unconfirmed -= unconfirmed
        reply, rest = waiter.reply
        if isinstance(reply, Failed):
            if reply.kind == "WouldBlock":
                raise WouldBlock(f"{self.service}: {reply.message}")
            raise remote_error(self.service, reply.kind, reply.message, reply.keys)
        return reply, rest

    def notify(self, body: Body) -> None:
        """Fire and forget: the service answers nothing (it logs a refusal). It handles the
        message before any later request of this client (one connection keeps order), so the
        reply to a later ``call`` confirms it; ``unconfirmed`` counts those not yet confirmed."""
        self._sock.send_nowait([encode(NO_REPLY, body)])
        self.unconfirmed += 1

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv()
            try:
                env = decode(frames[0].buffer)
            except Exception:  # noqa: BLE001 - a garbled reply must not kill the reader
                log.error("%s: undecodable reply dropped", self.service)
                continue
            waiter = self._pending.pop(env.id, None)
            if waiter is not None:
                waiter.reply = (env.body, frames[1:])
                waiter.event.set()
                continue
            orphan = self._orphans.pop(env.id, None)
            if orphan is not None:
                undo = orphan[1](env.body)
                if undo is not None:
                    self.notify(undo)
            self._prune_orphans()

    def _prune_orphans(self) -> None:
        if len(self._orphans) > 64:
            old = time.monotonic() - _ORPHAN_TTL_S
            for rid in [r for r, (t, _) in self._orphans.items() if t < old]:
                del self._orphans[rid]

    def close(self) -> None:
        self._sock.close()


@asynccontextmanager
async def open_rpc_client(ctx: zmq.Context, endpoint: str, **kwargs: Any) -> AsyncIterator[RpcClient]:
    client = RpcClient(ctx, endpoint, **kwargs)
    try:
        with first_error():
            async with anyio.create_task_group() as tg:
                tg.start_soon(client._read)
                try:
                    yield client
                finally:
                    tg.cancel_scope.cancel()
    finally:
        client.close()


class RpcServer:
    """A ROUTER bound to ``endpoint`` (``tcp://host:*`` picks a free port; see ``.endpoint``)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, *, name: str, curve: CurveKeys | None = None):
        self.name = name
        sock = make_socket(ctx, zmq.ROUTER, curve=curve, server=True)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise OSError(f"{name}: cannot bind {endpoint}: {exc}") from exc
        self.endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._sock = AsyncSocket(sock)
        self._waiting: dict[tuple[bytes, int], anyio.CancelScope] = {}

    async def serve(self, handler: Handler, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Answer requests until cancelled. ``handler`` returns a reply, or an awaitable of one
        for requests that wait (those run as tasks so the loop keeps serving)."""
        try:
            async with anyio.create_task_group() as tg:
                task_status.started(self.endpoint)
                while True:
                    frames = await self._sock.recv()
                    if len(frames) < 2:
                        continue
                    ident = frames[0].bytes
                    try:
                        env = decode(frames[1].buffer)
                    except Exception as exc:  # noqa: BLE001 - bad input from a peer
                        log.warning("%s: undecodable request dropped: %s", self.name, exc)
                        continue
                    if isinstance(env.body, Cancel):
                        scope = self._waiting.get((ident, env.body.id))
                        if scope is not None:
                            scope.cancel()
                        continue
                    try:
                        out = handler(env.body, frames[2:])
                    except Exception as exc:  # noqa: BLE001 - refused, reported to the caller
                        self._reply(ident, env.id, (failed(exc), ()))
                        continue
                    if isinstance(out, tuple):
                        self._reply(ident, env.id, out)
                    else:
                        tg.start_soon(self._finish, ident, env.id, out)
        finally:
            self._sock.close()

    async def _finish(self, ident: bytes, rid: int, pending: Awaitable[Reply]) -> None:
        out = None
        with anyio.CancelScope() as scope:
            self._waiting[(ident, rid)] = scope
            try:
                out = await pending
            except Exception as exc:  # noqa: BLE001
                out = (failed(exc), ())
            finally:
                del self._waiting[(ident, rid)]
        if out is not None:  # None: the caller cancelled
            self._reply(ident, rid, out)

    def _reply(self, ident: bytes, rid: int, out: Reply) -> None:
        body, frames = out
        if rid == NO_REPLY:  # a notification: nobody waits for the answer
            if isinstance(body, Failed):
                log.error("%s: a notification was refused: %s: %s (keys %s)", self.name, body.kind, body.message, body.keys[:8])
            return
        # A ROUTER drops a reply to a peer that is gone; nothing to do about it here.
        self._sock.send_nowait([ident, encode(rid, body), *frames])


@contextmanager
def first_error() -> Iterator[None]:
    """Parallel requests in a task group fail as one error, not an exception group: the first
    failure (e.g. the storage unit that is down) is what the caller needs to see."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        real = [e for e in leaves if not isinstance(e, anyio.get_cancelled_exc_class())]
        if not real:
            raise
        raise real[0] from (group if len(real) > 1 else None)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


def start_authenticator(ctx: zmq.Context, curve: CurveKeys) -> zmq.auth.thread.ThreadAuthenticator:
    """Accept CURVE clients that present ``curve.client_public`` and no others."""

    class _OneKey:
        def callback(self, domain: str, key: bytes) -> bool:
            return key == curve.client_public

    auth = zmq.auth.thread.ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("psrl", credentials_provider=_OneKey())
    return auth
