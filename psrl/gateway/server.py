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
import gc
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

from psrl.config.gateway import GatewayConfig

from .admin import check_admin, closed_summary, parse_open
from .app import build_app
from .capture import SessionCapture
from .chat_tokens import ChatTokenizer
from .http_guard import guarded
from .limits import Offload
from .sessions import Reply, SessionInfo, SessionTable
from .tool_calls import ToolParser
from .wire import GatewayError


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
    tool_call_errors: int = 0  # tool calls the model wrote that no parser could read


class Gateway:
    """The gateway. ``settings`` (the ``gateway`` config section) sets limits, names and
    timeouts; ``model_name``, ``host`` and ``port`` given here win over it. ``admin_token``
    enables ``POST /sessions`` and ``DELETE /sessions/{id}`` (``psrl serve``); ``max_model_len``
    (default: the engine's, when it tells) bounds prompts."""

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: ChatTokenizer | str | os.PathLike,
        *,
        settings: GatewayConfig | None = None,
        model_name: str | None = None,
        host: str | None = None,
        port: int | None = None,
        default_sampling: SamplingParams | None = None,
        tool_parser: ToolParser | None = None,
        max_model_len: int | None = None,
        admin_token: str | None = None,
        shutdown_timeout_s: int = 2,
    ) -> None:
        cfg = settings or GatewayConfig()
        host = host or cfg.host
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"the gateway binds loopback only, got host {host!r}")
        tok = tokenizer if isinstance(tokenizer, ChatTokenizer) else ChatTokenizer.from_pretrained(str(tokenizer))
        self.tokenizer = tok
        self.settings = cfg
        self.model_name = model_name or cfg.model_name
        self.max_body_bytes, self.body_timeout_s = cfg.max_body_bytes, cfg.body_timeout_s
        self.admin_token = admin_token
        self._host, self._port = host, cfg.port if port is None else port
        self._bound_port: int | None = None
        self._shutdown_timeout_s = shutdown_timeout_s
        self.sessions = SessionTable(
            engine, tok, model_name=self.model_name, base_url=lambda: self.url,
            default_sampling=default_sampling, tool_parser=tool_parser, model_aliases=tuple(cfg.model_aliases),
            max_model_len=max_model_len or getattr(engine, "max_model_len", None) or None,
            offload=Offload(cfg.tokenizer_workers, cfg.offload_min_chars),
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
            tool_call_errors=self.sessions.tool_call_errors,
        )

    # ---- what the HTTP app calls (on the loop that owns the sessions) ---------------------

    async def handle(self, kind: str, session_id: str, authorization: str | None, body: bytes) -> Reply:
        return await self.sessions.handle(kind, session_id, authorization, body)

    async def authorize(self, session_id: str | None, authorization: str | None) -> None:
        self.sessions.authorize(session_id, authorization)

    async def admin_open(self, authorization: str | None, body: bytes) -> dict[str, Any]:
        check_admin(self.admin_token, authorization)
        req, sampling = parse_open(body, self.sessions.default_sampling)
        try:
            info = self.open_session(req.session_id, sampling=sampling, lock_sampling=req.lock_sampling, max_calls=req.max_calls)
        except ValueError as e:
            raise GatewayError(409 if "already exists" in str(e) else 400, str(e)) from None
        return {"session_id": info.session_id, "base_url": info.base_url, "token": info.token, "model": self.model_name}

    async def admin_close(self, authorization: str | None, session_id: str) -> dict[str, Any]:
        check_admin(self.admin_token, authorization)
        try:
            capture = await self.close_session(session_id)
        except KeyError:
            raise GatewayError(404, f"no session {session_id!r}", "not_found_error") from None
        return closed_summary(capture)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

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
            self.sessions.warm_up()
            if self.settings.gc_freeze and gc.get_freeze_count() == 0:
                # Once per process, after start-up: see GatewayConfig.gc_freeze.
                gc.collect()
                gc.freeze()
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._close_idle_sessions)
                if sniffio.current_async_library() == "asyncio":
                    await self._serve_here(sock, task_status)
                else:
                    await self._serve_in_thread(sock, task_status)
        finally:
            self._bound_port = None
            sock.close()

    async def _close_idle_sessions(self) -> None:
        idle_s = self.settings.session_idle_timeout_s
        while True:
            await anyio.sleep(min(idle_s / 4, 60.0))
            await self.sessions.close_idle(idle_s)

    def _server(self, run: Any) -> _EmbeddedServer:
        config = uvicorn.Config(
            build_app(run, self), log_config=None, log_level="warning", access_log=False, lifespan="off", ws="none",
            timeout_graceful_shutdown=self._shutdown_timeout_s, timeout_keep_alive=self.settings.keep_alive_timeout_s,
        )  # fmt: skip
        config.load()
        config.http_protocol_class = guarded(config.http_protocol_class, self.settings.header_timeout_s)
        return _EmbeddedServer(config)

    async def _serve_here(self, sock: socket.socket, task_status: TaskStatus[str]) -> None:
        async def run(fn: Any, *args: Any) -> Any:
            return await fn(*args)

        server = self._server(run)
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

            async def run(fn: Any, *args: Any) -> Any:
                return await asyncio.wrap_future(portal.start_task_soon(fn, *args))

            server = self._server(run)
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
