"""``SandboxPool``: warm sandboxes of one spec, handed out one per rollout.

No background tasks: a released sandbox is reset by the releasing task and kept while fewer than
``warm`` are idle, so a pool in steady use stays warm; ``start()`` fills it. Creation is spaced to
``max_creates_per_s``, and at most ``max_concurrency`` sandboxes are out at once (``acquire``
waits). ``start()`` first sweeps what crashed earlier runs left behind.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio

from psrl.config.sandbox import SandboxPoolConfig, SandboxSpec
from psrl.log import get_logger

from .base import ReapReport, Sandbox, SandboxBackend, SandboxError
from .registry import make_backend

_RESET_TIMEOUT_S = 60.0
log = get_logger("psrl.sandboxes.pool")


@dataclass(frozen=True)
class PoolStatistics:
    idle: int
    in_use: int
    created: int
    reused: int
    closed: int
    reaped: ReapReport
    reset_failures: int = 0  # released sandboxes whose reset failed or timed out (closed, not reused)

    def metrics(self) -> dict[str, float]:
        """The pool's counters as step metrics, ``sandbox/<name>``."""
        return {
            "sandbox/created": float(self.created), "sandbox/reused": float(self.reused),
            "sandbox/closed": float(self.closed), "sandbox/reset_failures": float(self.reset_failures),
        }


class SandboxPool:
    """``async with SandboxPool(spec, cfg) as pool: async with pool.acquire() as sb: ...``"""

    def __init__(
        self, spec: SandboxSpec, config: SandboxPoolConfig | None = None, *,
        backend: SandboxBackend | None = None,
    ) -> None:
        self.spec = spec
        self.config = config or SandboxPoolConfig()
        self._backend = backend
        self._owns_backend = backend is None
        self._idle: list[Sandbox] = []
        self._in_use: set[Sandbox] = set()  # type: ignore[type-arg]
        self._slots = anyio.Semaphore(self.config.max_concurrency)
        self._start_lock = anyio.Lock()
        self._next_create = 0.0
        self._started = self._closed = False
        self._created = self._reused = self._closed_count = 0
        self._reset_failures = 0
        self._reaped = ReapReport()

    @property
    def backend(self) -> SandboxBackend:
        if self._backend is None:
            self._backend = make_backend(self.spec)
        return self._backend

    async def start(self) -> ReapReport:
        """Sweep leftovers of dead runs, then create ``warm`` sandboxes. Idempotent."""
        async with self._start_lock:
            if self._closed:
                raise SandboxError("sandbox pool is closed")
            if self._started:
                return self._reaped
            self._reaped = await self.backend.reap_stale()
            self._started = True
            while len(self._idle) < self.config.warm and not self._closed:
                self._idle.append(await self._create())
            return self._reaped

    @asynccontextmanager
    async def acquire(self) -> AsyncIterator[Sandbox]:
        """A sandbox for the body of the ``async with``; reset and kept (or closed) afterwards."""
        if not self._started:
            await self.start()
        async with self._slots:
            if self._closed:
                raise SandboxError("sandbox pool is closed")
            if self._idle:
                sb = self._idle.pop()
                self._reused += 1
            else:
                sb = await self._create()
            self._in_use.add(sb)
            try:
                yield sb
            finally:
                self._in_use.discard(sb)
                with anyio.CancelScope(shield=True):
                    await self._release(sb)

    async def _create(self) -> Sandbox:
        now = anyio.current_time()
        start_at = max(now, self._next_create)
        self._next_create = start_at + 1.0 / self.config.max_creates_per_s
        if start_at > now:
            await anyio.sleep(start_at - now)
        sb = await self.backend.create()
        self._created += 1
        return sb

    async def _release(self, sb: Sandbox) -> None:
        if not self._closed and len(self._idle) < self.config.warm:
            try:
                with anyio.fail_after(_RESET_TIMEOUT_S):
                    await sb.reset()
            except Exception as e:  # a sandbox that cannot be reset is not reused; counted, not silent
                self._reset_failures += 1
                log.warning("sandbox reset failed; closing it instead of reusing it", sandbox=getattr(sb, "name", repr(sb)),
                            error=f"{type(e).__name__}: {e}", reset_failures=self._reset_failures)
            else:
                # Checked again: other releases may have refilled the pool while this one reset.
                if not self._closed and len(self._idle) < self.config.warm:
                    self._idle.append(sb)
                    return
        await self._close_one(sb)

    async def _close_one(self, sb: Sandbox) -> None:
        self._closed_count += 1
        await sb.aclose()

    async def aclose(self) -> None:
        """Close every sandbox, idle or in use (their running commands are killed)."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            errors: list[BaseException] = []
            for sb in [*self._idle, *self._in_use]:
                try:
                    await sb.aclose()  # in-use ones are counted when their holder releases them
                except Exception as e:  # close the rest regardless
                    errors.append(e)
            self._closed_count += len(self._idle)
            self._idle.clear()
            if self._owns_backend and self._backend is not None:
                try:
                    await self._backend.aclose()
                except Exception as e:
                    errors.append(e)
            if errors:
                raise SandboxError(f"{len(errors)} sandbox(es) failed to close: {errors[0]!r}") from errors[0]

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(
            idle=len(self._idle), in_use=len(self._in_use), created=self._created,
            reused=self._reused, closed=self._closed_count, reaped=self._reaped, reset_failures=self._reset_failures,
        )

    async def __aenter__(self) -> SandboxPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
