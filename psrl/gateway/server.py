"""``Gateway``: the session-scoped OpenAI-compatible API, served by uvicorn on loopback.

Under asyncio the server runs on the caller's loop, inside the caller's task group. uvicorn is
asyncio-only, so under trio it runs on its own asyncio loop in a worker thread and every request
is handed to the trio loop through a blocking portal: session state and engine calls stay on
the loop that owns them either way.

    async with open_gateway(engine, tokenizer) as gw:
        s = gw.open_session("episode-1", max_calls=20)
        # point any OpenAI client at s.base_url with api_key=s.token ...
        capture = await gw.close_session(s.session_id)
        trajectories = capture.trajectories(key="episode-1")
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import sniffio
import uvicorn
from anyio.abc import TaskStatus
from anyio.from_thread import BlockingPortal

from psrl.engines.base import InferenceEngine, SamplingParams

from .app import build_app
from .capture import SessionCapture
from .chat_tokens import ChatTokenizer
from .sessions import Reply, SessionInfo, SessionTable
from .tool_calls import ToolCallExtractor


class _EmbeddedServer(uvicorn.Server):
    # The host process owns its signals; a library server must not take over Ctrl-C.
    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


@dataclass(frozen=True)
class GatewayStatistics:
    open_sessions: int
    sessions: int
    calls: int
    failed_calls: int
    url: str | None


class Gateway:
    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: ChatTokenizer | str | os.PathLike,
        *,
        model_name: str = "psrl-policy",
        host: str = "127.0.0.1",
        port: int = 0,
        default_sampling: SamplingParams | None = None,
        tool_calls: ToolCallExtractor | None = None,
        shutdown_timeout_s: int = 2,
    ) -> None:
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"the gateway binds loopback only, got host {host!r}")
        tok = tokenizer if isinstance(tokenizer, ChatTokenizer) else ChatTokenizer.from_pretrained(str(tokenizer))
        self.tokenizer = tok
        self.model_name = model_name
        self._host, self._port = host, port
        self._bound_port: int | None = None
        self._shutdown_timeout_s = shutdown_timeout_s
        self.sessions = SessionTable(
            engine, tok, model_name=model_name, base_url=lambda: self.url,
            default_sampling=default_sampling, tool_calls=tool_calls,
        )  # fmt: skip

    @property
    def url(self) -> str:
        if self._bound_port is None:
            raise RuntimeError("the gateway is not serving yet: start Gateway.serve in a task group first")
        return f"http://{self._host}:{self._bound_port}"

    # ---- sessions (call these on the loop that runs serve) -------------------------------

    def open_session(
        self,
        session_id: str | None = None,
        *,
        sampling: SamplingParams | None = None,
        lock_sampling: bool = False,
        max_calls: int | None = None,
    ) -> SessionInfo:
        """A new session with its own bearer token. ``max_calls`` bounds the model calls: the
        call after the last allowed one closes the session (410). ``lock_sampling`` keeps the
        session's temperature, top-p, top-k and seed whatever the agent sends."""
        return self.sessions.open(session_id, sampling=sampling, lock_sampling=lock_sampling, max_calls=max_calls)

    async def close_session(self, session_id: str, reason: str = "closed") -> SessionCapture:
        return await self.sessions.close(session_id, reason)

    def capture(self, session_id: str) -> SessionCapture:
        return self.sessions.get(session_id).capture

    def statistics(self) -> GatewayStatistics:
        all_sessions = self.sessions.all()
        return GatewayStatistics(
            open_sessions=self.sessions.open_sessions(),
            sessions=len(all_sessions),
            calls=sum(s.capture.num_calls for s in all_sessions),
            failed_calls=sum(s.capture.failed_calls for s in all_sessions),
            url=self.url if self._bound_port is not None else None,
        )

    # ---- serving ------------------------------------------------------------------------

    async def serve(self, *, task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; ``task_status.started(url)`` once connections are accepted."""
        if self._bound_port is not None:
            raise RuntimeError(f"the gateway is already serving at {self.url}")
        # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted sockets only when the
        # listener says TCP, and without it every keep-alive call waits ~40 ms on delayed ACKs.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind((self._host, self._port))
            sock.listen(2048)  # connections queue from here on, before uvicorn's first accept
            sock.setblocking(False)
            self._bound_port = sock.getsockname()[1]
            if sniffio.current_async_library() == "asyncio":
                await self._serve_here(sock, task_status)
            else:
                await self._serve_in_thread(sock, task_status)
        finally:
            self._bound_port = None
            sock.close()

    def _server(self, call: Any) -> _EmbeddedServer:
        app = build_app(call, self._authorize, self.model_name, self._decode)
        config = uvicorn.Config(
            app, log_config=None, log_level="warning", access_log=False, lifespan="off", ws="none",
            timeout_graceful_shutdown=self._shutdown_timeout_s, timeout_keep_alive=30,
        )  # fmt: skip
        return _EmbeddedServer(config)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    async def _authorize(self, session_id: str | None, authorization: str | None) -> None:
        self.sessions.authorize(session_id, authorization)

    async def _serve_here(self, sock: socket.socket, task_status: TaskStatus[str]) -> None:
        server = self._server(self.sessions.handle)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._run_shielded, server, sock)
            task_status.started(self.url)
            try:
                await anyio.sleep_forever()
            finally:
                server.should_exit = True  # graceful: uvicorn notices on its next 0.1 s tick

    async def _run_shielded(self, server: _EmbeddedServer, sock: socket.socket) -> None:
        with anyio.CancelScope(shield=True):
            await server.serve(sockets=[sock])

    async def _serve_in_thread(self, sock: socket.socket, task_status: TaskStatus[str]) -> None:
        async with BlockingPortal() as portal:

            async def call(kind: str, sid: str, auth: str | None, body: bytes) -> Reply:
                future = portal.start_task_soon(self.sessions.handle, kind, sid, auth, body)
                return await asyncio.wrap_future(future)

            server = self._server(call)
            async with anyio.create_task_group() as tg:
                # A limiter of its own: the server thread lives as long as the gateway and must
                # not hold one of the shared worker-thread tokens that agents' threads need.
                # The coroutine is made in the thread: one made here would never be awaited if
                # the gateway closed before the thread started.
                serve = partial(anyio.to_thread.run_sync, lambda: asyncio.run(server.serve([sock])), limiter=anyio.CapacityLimiter(1))
                tg.start_soon(serve)
                task_status.started(self.url)
                try:
                    await anyio.sleep_forever()
                finally:
                    server.should_exit = True


@contextlib.asynccontextmanager
async def open_gateway(
    engine: InferenceEngine, tokenizer: ChatTokenizer | str | os.PathLike, **kwargs: Any
) -> AsyncIterator[Gateway]:
    """A serving gateway for the duration of the block; stopped (sockets closed) on exit."""
    gateway = Gateway(engine, tokenizer, **kwargs)
    async with anyio.create_task_group() as tg:
        await tg.start(gateway.serve)
        try:
            yield gateway
        finally:
            tg.cancel_scope.cancel()
