"""ZeroMQ sockets for anyio, on asyncio and trio alike.

``zmq.asyncio`` serves asyncio only, so sockets here are non-blocking and a single receiving
task waits on the socket's file descriptor. That descriptor is edge-triggered: it fires when
ZeroMQ's command mailbox changes, and *any* operation on the socket (a send from another task)
may consume the signal while a message sits unread. So after every send we look at ``EVENTS``
and, if input is pending, wake the receiver; the receiver then drains. Everything runs in the
event loop's thread, so the check and the wait cannot race.

On asyncio the descriptor stays registered with the loop for the socket's life (a callback that
reads ``EVENTS``, which also re-arms the descriptor, and wakes the receiver): registering and
unregistering it around every wait (``anyio.wait_readable``) was ~30% of a small request's client
CPU (``psrl bench queue``). On trio, ``anyio.wait_readable`` per wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
import sniffio
import zmq

_SEND_RETRY_S = 0.001


@dataclass(frozen=True)
class CurveKeys:
    """Z85 key pairs for ZeroMQ CURVE: the services' pair and the one pair clients may use.

    Services accept only clients presenting ``client_public`` (checked by a ZAP handler)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        sp, ss = zmq.curve_keypair()
        cp, cs = zmq.curve_keypair()
        return cls(sp, ss, cp, cs)


def make_socket(ctx: zmq.Context, kind: int, *, curve: CurveKeys | None = None, server: bool = False) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # flow control is the queue's capacity, not socket buffers
    sock.setsockopt(zmq.RCVHWM, 0)
    if curve is not None:
        if server:
            sock.curve_server = True
            sock.curve_secretkey = curve.server_secret
            sock.curve_publickey = curve.server_public
            sock.zap_domain = b"psrl"
        else:
            sock.curve_serverkey = curve.server_public
            sock.curve_publickey = curve.client_public
            sock.curve_secretkey = curve.client_secret
    return sock


class AsyncSocket:
    """A ZeroMQ socket: ``send`` from any task, ``recv`` from one task at a time."""

    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self._fd = sock.getsockopt(zmq.FD)
        self._wait: anyio.CancelScope | asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # asyncio: the loop our reader is on

    def send_nowait(self, frames: Sequence) -> bool:
        """Queue a multipart message; False when ZeroMQ cannot take it now."""
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        finally:
            self._poke()
        return True

    async def send(self, frames: Sequence) -> None:
        # Sockets here have no high-water mark, so this waits only while a DEALER has no peer
        # pipe yet or a ROUTER_MANDATORY peer is gone; callers bound it with their timeouts.
        while not self.send_nowait(frames):
            await anyio.sleep(_SEND_RETRY_S)

    async def recv(self) -> list[zmq.Frame]:
        while True:
            try:
                return self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                pass
            if sniffio.current_async_library() == "asyncio":
                loop = asyncio.get_running_loop()
                if loop is not self._loop:  # first wait, or a socket carried over to another loop
                    self._unregister()
                    self._loop = loop
                    loop.add_reader(self._fd, self._readable)
                self._wait = loop.create_future()
                try:
                    await self._wait
                finally:
                    self._wait = None
                continue
            with anyio.CancelScope() as scope:
                self._wait = scope
                try:
                    await anyio.wait_readable(self._fd)
                finally:
                    self._wait = None

    def _readable(self) -> None:
        """asyncio reader callback: reading ``EVENTS`` re-arms the descriptor (else the loop
        would call us again at once); a message waiting wakes the receiver, if any."""
        if self.sock.closed:
            return
        if self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._wake()

    def _poke(self) -> None:
        if self._wait is not None and self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._wake()

    def _wake(self) -> None:
        wait = self._wait
        if isinstance(wait, asyncio.Future):
            if not wait.done():
                wait.set_result(None)
        elif wait is not None:
            wait.cancel()

    def _unregister(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._loop = None

    def close(self) -> None:
        self._unregister()
        self._wake()  # a receiver then finds the socket closed
        self.sock.close(linger=0)
