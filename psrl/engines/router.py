"""A ``Router`` spreads requests over engine replicas and itself implements ``InferenceEngine``.

- A session sticks to one replica, so its turns reuse that replica's prefix cache; requests
  without a session go to the replica with the fewest requests in flight.
- Replicas can be added and removed while requests run. The requests of a removed replica are
  aborted there and continue on another replica from the tokens already produced (prompt +
  partial output resubmitted with the remaining ``max_tokens``).
- A replica that fails (``generate`` raises, or it reports ``is_alive() == False`` after an error
  or an abort nobody asked for) is taken out the same way; its requests continue elsewhere.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

from psrl.log import get_logger

from .base import EngineCounters, EngineStatistics, FinishReason, GenerateRequest, GenerateResult, InferenceEngine

log = get_logger("psrl.engines.router")


@dataclass(eq=False)
class _Replica:
    name: str
    engine: InferenceEngine
    in_flight: int = 0
    assigned: int = 0
    drained: anyio.Event | None = None  # set when a replica being removed has no request left


@dataclass
class _Routed:
    replica: _Replica | None = None
    user_aborted: bool = False
    migrate: bool = False  # its replica is being removed: continue elsewhere


@dataclass
class _Partial:
    ids: list[np.ndarray] = dataclasses.field(default_factory=list)
    logprobs: list[np.ndarray] = dataclasses.field(default_factory=list)
    versions: list[np.ndarray] = dataclasses.field(default_factory=list)
    count: int = 0
    first_token_s: float | None = None  # of the first part that measured it

    def add(self, r: GenerateResult) -> None:
        if self.first_token_s is None:
            self.first_token_s = r.first_token_s
        self.ids.append(r.output_ids)
        self.logprobs.append(r.logprobs)
        self.versions.append(r.versions)
        self.count += len(r.output_ids)

    def result(self, rid: str, finish: FinishReason, error: str | None = None, stop: Any = None) -> GenerateResult:
        def cat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
            return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)

        return GenerateResult(
            rid, cat(self.ids, np.int32), cat(self.logprobs, np.float32), cat(self.versions, np.int32), finish, error, stop,
            self.first_token_s,
        )


def _alive(engine: InferenceEngine) -> bool:
    # Liveness is optional on the Protocol: an engine without is_alive() is alive until it raises.
    is_alive = getattr(engine, "is_alive", None)
    return True if is_alive is None else bool(is_alive())


class Router:
    """Implements ``InferenceEngine`` over named replicas.

    The router owns its replicas (``aclose`` and ``remove_replica`` close them) unless
    ``close_replicas=False``, for engines shared with other users.
    """

    def __init__(
        self,
        replicas: Mapping[str, InferenceEngine] | Sequence[InferenceEngine] = (),
        *,
        max_sticky_sessions: int = 100_000,
        close_replicas: bool = True,
    ) -> None:
        self._close_replicas = close_replicas
        named = replicas.items() if isinstance(replicas, Mapping) else ((f"r{i}", e) for i, e in enumerate(replicas))
        self._live: dict[str, _Replica] = {n: _Replica(n, e) for n, e in named}
        self._retired: list[_Replica] = []  # failed replicas that did not close cleanly
        self._failures: dict[str, str] = {}
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._max_sessions = max_sticky_sessions
        self._routed: dict[str, _Routed] = {}
        self._paused = False
        self._closed = False
        self._version = min((e.statistics().version for e in self.replicas.values()), default=0)
        self._counters = EngineCounters()
        self._migrations = 0
        self._next_name = len(self._live)

    # ---- replicas -------------------------------------------------------------------------------

    @property
    def replicas(self) -> dict[str, InferenceEngine]:
        return {n: r.engine for n, r in self._live.items()}

    def session_replica(self, session_id: str) -> str | None:
        """The replica a session is pinned to, if any."""
        return self._sessions.get(session_id)

    def end_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    async def add_replica(self, engine: InferenceEngine, name: str | None = None) -> str:
        """Start routing to ``engine`` (paused first if the router is paused); returns its name."""
        if self._closed:
            raise RuntimeError("router is closed")
        if name is None:
            while f"r{self._next_name}" in self._live:
                self._next_name += 1
            name = f"r{self._next_name}"
        if name in self._live:
            raise ValueError(f"a replica named {name!r} is already routed to")
        if self._paused:
            await engine.pause()
        self._live[name] = _Replica(name, engine)
        return name

    async def remove_replica(self, name: str, *, close: bool | None = None) -> InferenceEngine:
        """Stop routing to a replica; its requests continue on the others. Returns the engine,
        closed if ``close`` (default: whether the router owns its replicas)."""
        replica = self._live.pop(name, None)
        if replica is None:
            raise KeyError(f"no replica named {name!r}; replicas: {sorted(self._live)}")
        await self._migrate_away(replica)
        if self._close_replicas if close is None else close:
            with anyio.CancelScope(shield=True):
                await replica.engine.aclose()
        return replica.engine

    async def _migrate_away(self, replica: _Replica) -> None:
        replica.drained = anyio.Event()
        if replica.in_flight == 0:
            replica.drained.set()
        for rid, routed in list(self._routed.items()):
            if routed.replica is replica:
                routed.migrate = True
                await replica.engine.abort(rid)
        await replica.drained.wait()

    async def _fail(self, replica: _Replica, reason: str) -> None:
        if self._live.get(replica.name) is not replica:
            return  # already taken out by a concurrent request or a removal
        del self._live[replica.name]
        self._failures[replica.name] = reason
        if not self._close_replicas:
            return
        try:
            with anyio.CancelScope(shield=True):
                await replica.engine.aclose()
        except Exception as exc:  # a dead replica may fail to close cleanly; aclose retries it
            log.warning("failed replica did not close; retried at aclose", replica=replica.name, error=f"{type(exc).__name__}: {exc}")
            self._retired.append(replica)

    def _pick(self, session_id: str | None) -> _Replica | None:
        if not self._live:
            return None
        if session_id is not None:
            pinned = self._live.get(self._sessions.get(session_id, ""))
            if pinned is not None:
                self._sessions.move_to_end(session_id)
                return pinned
        replica = min(self._live.values(), key=lambda r: (r.in_flight, r.assigned))
        if session_id is not None:
            self._sessions[session_id] = replica.name
            if len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        return replica

    # ---- InferenceEngine ------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        rid = request.request_id
        if self._closed:
            return GenerateResult.failed(rid, "router is closed")
        if rid in self._routed:
            return GenerateResult.failed(rid, f"request id {rid!r} is already in flight")
        routed = self._routed[rid] = _Routed()
        partial = _Partial()
        try:
            return await self._route(request, routed, partial)
        finally:
            del self._routed[rid]
            self._counters.count_result(partial.count)

    async def _route(self, request: GenerateRequest, routed: _Routed, partial: _Partial) -> GenerateResult:
        rid, sampling = request.request_id, request.sampling
        while True:
            if routed.user_aborted:
                return partial.result(rid, FinishReason.ABORT)
            replica = self._pick(request.session_id)
            if replica is None:
                failures = "; ".join(f"{n}: {why}" for n, why in self._failures.items()) or "none were added"
                return partial.result(rid, FinishReason.ERROR, f"no live replica to serve the request (failed replicas: {failures})")
            if partial.count and partial.count >= sampling.max_tokens:
                return partial.result(rid, FinishReason.LENGTH)
            prompt = np.concatenate([request.prompt_ids, *partial.ids]) if partial.count else request.prompt_ids
            sub = GenerateRequest(
                prompt, dataclasses.replace(sampling, max_tokens=sampling.max_tokens - partial.count), rid, request.session_id
            )
            routed.replica, routed.migrate = replica, False
            replica.in_flight += 1
            replica.assigned += 1
            result: GenerateResult | None = None
            try:
                result = await replica.engine.generate(sub)
                failure = None
            except Exception as exc:  # the Protocol's generate does not raise for a bad request
                failure = f"generate raised {type(exc).__name__}: {exc}"
            finally:
                replica.in_flight -= 1
                routed.replica = None
                if replica.drained is not None and replica.in_flight == 0:
                    replica.drained.set()
            if result is not None:
                partial.add(result)
                unexpected = result.finish_reason is FinishReason.ERROR or (
                    result.finish_reason is FinishReason.ABORT and not routed.user_aborted
                )
                if unexpected and not _alive(replica.engine):
                    failure = result.error or f"replica stopped ({result.finish_reason})"
            if failure is not None:
                await self._fail(replica, failure)
                self._migrations += 1
                continue
            assert result is not None
            if result.finish_reason is FinishReason.ABORT and routed.migrate and not routed.user_aborted:
                self._migrations += 1
                continue
            return partial.result(rid, result.finish_reason, result.error, result.stop_reason)

    async def abort(self, request_id: str) -> None:
        routed = self._routed.get(request_id)
        if routed is None:
            return
        routed.user_aborted = True
        if routed.replica is not None:
            await routed.replica.engine.abort(request_id)

    async def pause(self) -> None:
        self._paused = True
        await self._each(lambda e: e.pause())

    async def resume(self) -> None:
        self._paused = False
        await self._each(lambda e: e.resume())

    async def _each(self, call: Any) -> None:
        async with anyio.create_task_group() as tg:
            for replica in list(self._live.values()):
                tg.start_soon(call, replica.engine)

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Update every replica concurrently (each replica streams the tensors to its workers).

        A replica that refuses the weights as bad input (``ValueError``/``TypeError``: unknown
        names, wrong shapes) stays in, and the refusal is raised after all replicas answered.
        A replica whose update fails otherwise is taken out; that raises only if none succeeded.
        """
        named = list(named_tensors)
        await self._update_each(lambda engine: engine.update_weights(named, version), version, final=True)

    def receives_weights(self) -> bool:
        """Whether every live replica can load a version streamed from a trainer's sender."""
        return all(callable(getattr(r.engine, "receive_weights", None)) for r in self._live.values())

    def weight_receivers(self) -> int:
        """Receivers a direct sync to every live replica has (``receive_weights``)."""
        return sum(int(getattr(r.engine, "weight_receivers", lambda: 1)()) for r in self._live.values())

    async def init_weight_group(self, rendezvous: dict[str, Any]) -> None:
        """Every replica's workers join the weight-broadcast group: replica k's take the ranks
        after replica k-1's (rank 0 is the trainer's)."""
        first = int(rendezvous.get("first_rank", 1))
        async with anyio.create_task_group() as tg:
            for r in self._live.values():
                tg.start_soon(r.engine.init_weight_group, {**rendezvous, "first_rank": first})
                first += int(r.engine.weight_receivers())

    async def receive_weights(self, spec: dict[str, Any], version: int, *, final: bool = True) -> None:
        """Every replica loads ``version`` from the trainer's sender(s) in ``spec``.

        A replica whose sync fails stays paused or restored (it never serves a mixture); the
        error, naming the bucket, is raised after all replicas answered. With ``final`` (no retry
        follows) a replica left with a partial version is taken out."""
        await self._update_each(lambda engine: engine.receive_weights(spec, version), version, final=final)

    async def _update_each(self, update: Any, version: int, *, final: bool) -> None:
        from .weight_transfer import WeightTransferError

        start = time.perf_counter()
        replicas = list(self._live.values())
        refused: dict[str, Exception] = {}
        failed: dict[str, str] = {}

        async def one(replica: _Replica) -> None:
            try:
                await update(replica.engine)
            except (ValueError, TypeError) as exc:
                refused[replica.name] = exc
            except WeightTransferError as exc:
                if exc.restored or not final:
                    refused[replica.name] = exc
                else:
                    failed[replica.name] = f"weight sync to version {version} failed: {exc}"
            except Exception as exc:
                failed[replica.name] = f"weight update to version {version} failed: {type(exc).__name__}: {exc}"

        async with anyio.create_task_group() as tg:
            for replica in replicas:
                tg.start_soon(one, replica)
        for replica in replicas:
            if replica.name in failed:
                await self._fail(replica, failed[replica.name])
        if refused:
            name, exc = next(iter(refused.items()))
            if isinstance(exc, WeightTransferError):
                raise WeightTransferError(f"replica {name}: {exc}", bucket=exc.bucket, restored=exc.restored) from exc
            raise type(exc)(f"replica {name}: {exc}") from exc
        if replicas and len(failed) == len(replicas):
            raise RuntimeError("; ".join(f"{n}: {e}" for n, e in failed.items()))
        self._version = version
        self._counters.count_update(time.perf_counter() - start)

    def statistics(self) -> EngineStatistics:
        per_replica = {n: r.engine.statistics() for n, r in self._live.items()}
        return self._counters.statistics(
            version=min((s.version for s in per_replica.values()), default=self._version),
            requests_in_flight=len(self._routed),
            paused=self._paused,
            extra={
                "replicas": per_replica,
                "in_flight_per_replica": {n: r.in_flight for n, r in self._live.items()},
                "failed_replicas": dict(self._failures),
                "migrations": self._migrations,
                "sticky_sessions": len(self._sessions),
            },
        )

    async def aclose(self) -> None:
        """Abort the requests in flight, then close every replica (if the router owns them), even
        if some fail to close; re-raise the first error."""
        self._closed = True
        with anyio.CancelScope(shield=True):
            for rid in list(self._routed):
                try:
                    await self.abort(rid)
                except Exception as exc:  # a replica that cannot abort is closed below anyway
                    log.warning("abort failed while closing the router", request_id=rid, error=f"{type(exc).__name__}: {exc}")
        replicas = [*self._live.values(), *self._retired]
        self._live.clear()
        self._retired.clear()
        first_error: BaseException | None = None
        if not self._close_replicas:
            return
        with anyio.CancelScope(shield=True):
            for replica in replicas:
                try:
                    await replica.engine.aclose()
                except Exception as exc:
                    first_error = first_error or exc
        if first_error is not None:
            raise first_error
