"""Engine replicas as Ray actors, each holding a ``VLLMEngine``, behind the driver's ``Router``.

``RayEngine`` implements ``InferenceEngine`` by calling its actor, so the Router (sticky
sessions, least-loaded routing, replica failure and migration) works unchanged over replicas on
any node. A request cancelled in the driver is aborted in the actor. An actor that dies turns its
requests into ERROR results and reports ``is_alive() == False``; the Router then moves them to
the other replicas.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Iterable
from typing import Any

import anyio

from psrl.config.rollout import EngineConfig, ModelConfig, RolloutConfig
from psrl.config.schema import RayConfig
from psrl.engines import EngineStatistics, GenerateRequest, GenerateResult
from psrl.engines.router import Router
from psrl.log import get_logger

from .common import actor_options, kill_actors, resolve, wait_started

log = get_logger("psrl.ray")

_CLOSE_TIMEOUT_S = 60.0
# An async actor serves this many calls at once; a replica's own max_num_seqs bounds generation.
_ACTOR_CONCURRENCY = 10_000


class EngineActor:
    """A ``VLLMEngine`` in a Ray actor (async methods: many requests in flight at once)."""

    def __init__(self) -> None:
        self.engine: Any = None

    async def start(self, model: str, cfg_json: str, dtype: str, version: int, name: str) -> EngineStatistics:
        import ray

        from psrl.engines.vllm_engine import VLLMEngine
        from psrl.models import resolve_model_path

        path = await anyio.to_thread.run_sync(resolve_model_path, model)  # on this node
        self.engine = await VLLMEngine.create(path, EngineConfig.model_validate_json(cfg_json), dtype=dtype, version=version, name=name)
        stats = self.engine.statistics()
        return dataclasses.replace(stats, extra={**stats.extra, "node": ray.util.get_node_ip_address(),
                                                 "weight_receivers": self.engine.weight_receivers()})

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return await self.engine.generate(request)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def pause(self) -> EngineStatistics:
        await self.engine.pause()
        return self.engine.statistics()

    async def resume(self) -> EngineStatistics:
        await self.engine.resume()
        return self.engine.statistics()

    async def update_weights(self, named_tensors: list[tuple[str, Any]], version: int) -> EngineStatistics:
        await self.engine.update_weights(named_tensors, version)
        return self.engine.statistics()

    async def receive_weights(self, spec: dict[str, Any], version: int) -> tuple[EngineStatistics, dict[str, Any] | None]:
        """Load ``version`` straight from the trainer ranks' senders; a failed sync comes back as
        data (its bucket, whether the previous version was restored), not as a Ray error."""
        from psrl.engines.weight_transfer import WeightTransferError

        try:
            await self.engine.receive_weights(spec, version)
        except WeightTransferError as exc:
            return self.engine.statistics(), {"error": str(exc), "bucket": exc.bucket, "restored": exc.restored}
        return self.engine.statistics(), None

    def statistics(self) -> EngineStatistics:
        return self.engine.statistics()

    def is_alive(self) -> bool:
        return self.engine is not None and self.engine.is_alive()

    async def aclose(self) -> None:
        if self.engine is not None:
            await self.engine.aclose()


class RayEngine:
    """Implements ``InferenceEngine`` over an ``EngineActor``.

    ``statistics()`` must not block, so it answers from this side: requests in flight, done and
    tokens counted here; version, pause state and update timings as the actor last reported them
    (every control call returns them)."""

    def __init__(self, actor: Any, name: str, started: EngineStatistics) -> None:
        self.actor = actor
        self.name = name
        self._stats = started
        self._in_flight = 0
        self._done = 0
        self._tokens = 0
        self._dead: str | None = None
        self._closed = False

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self._dead is not None or self._closed:
            return GenerateResult.failed(request.request_id, f"engine actor {self.name} is gone: {self._dead or 'closed'}")
        self._in_flight += 1
        try:
            ref = self.actor.generate.remote(request)
            try:
                result = await resolve(ref)
            except anyio.get_cancelled_exc_class():
                self.actor.abort.remote(request.request_id)  # fire and forget: the actor stops it
                raise
            except Exception as exc:
                return self._failed(request.request_id, exc)
        finally:
            self._in_flight -= 1
        self._done += 1
        self._tokens += len(result.output_ids)
        return result

    def _failed(self, request_id: str, exc: Exception) -> GenerateResult:
        import ray

        if isinstance(exc, ray.exceptions.RayActorError):
            self._dead = f"{type(exc).__name__}: {exc}"
            log.error("engine actor died", replica=self.name, error=self._dead)
        return GenerateResult.failed(request_id, f"engine actor {self.name}: {type(exc).__name__}: {exc}")

    async def _control(self, ref: Any) -> None:
        import ray

        try:
            self._stats = await resolve(ref)
        except ray.exceptions.RayActorError as exc:
            self._dead = f"{type(exc).__name__}: {exc}"
            raise RuntimeError(f"engine actor {self.name} is gone: {self._dead}") from None
        except ray.exceptions.RayTaskError as exc:
            # The engine's own error (e.g. a ValueError refusing bad weights) keeps its type.
            raise exc.as_instanceof_cause() from None

    async def abort(self, request_id: str) -> None:
        if self._dead is None:
            await resolve(self.actor.abort.remote(request_id))

    async def pause(self) -> None:
        await self._control(self.actor.pause.remote())

    async def resume(self) -> None:
        await self._control(self.actor.resume.remote())

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Tensors held by this process, sent to the actor (trainers on Ray use
        ``receive_weights`` instead: their weights never pass through the driver)."""
        await self._control(self.actor.update_weights.remote(list(named_tensors), version))

    async def receive_weights(self, spec: dict[str, Any], version: int, *, final: bool = True) -> None:
        """The actor's engine loads ``version`` from the senders in ``spec`` (trainer ranks):
        only this metadata passes through here."""
        import ray

        from psrl.engines.weight_transfer import WeightTransferError

        try:
            self._stats, error = await resolve(self.actor.receive_weights.remote(spec, version))
        except ray.exceptions.RayActorError as exc:
            self._dead = f"{type(exc).__name__}: {exc}"
            raise RuntimeError(f"engine actor {self.name} is gone: {self._dead}") from None
        if error is not None:
            raise WeightTransferError(error["error"], bucket=error["bucket"], restored=error["restored"])

    def weight_receivers(self) -> int:
        return int(self._stats.extra.get("weight_receivers", 1))

    def is_alive(self) -> bool:
        return self._dead is None and not self._closed

    def statistics(self) -> EngineStatistics:
        return dataclasses.replace(
            self._stats, requests_in_flight=self._in_flight, requests_done=self._done, tokens_generated=self._tokens,
            extra={**self._stats.extra, "actor_alive": self.is_alive(), "dead_reason": self._dead},
        )

    async def aclose(self) -> None:
        """Shut vLLM down in the actor (bounded), then kill the actor, even if that failed."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._dead is None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_TIMEOUT_S):
                    await resolve(self.actor.aclose.remote())
        except Exception as exc:  # a dying actor may not answer; it is killed below
            log.warning("engine actor did not close cleanly", replica=self.name, error=str(exc))
        finally:
            kill_actors([self.actor])


async def create_ray_engine(rollout: RolloutConfig, model: ModelConfig, ray_cfg: RayConfig, *, version: int = 0) -> Router:
    """``rollout.engine.replicas`` engine actors, started concurrently, behind a Router the caller
    owns (``aclose`` closes the replicas and kills their actors)."""
    import ray

    cfg = rollout.engine
    if cfg.type != "vllm":
        raise ValueError(f"launcher=ray builds vllm engines (rollout.engine.type={cfg.type!r})")
    res = ray_cfg.engine
    if res.num_gpus and res.num_gpus < cfg.tensor_parallel_size:
        raise ValueError(
            f"ray.engine.num_gpus={res.num_gpus:g} is less than rollout.engine.tensor_parallel_size={cfg.tensor_parallel_size}"
        )
    cls = ray.remote(EngineActor).options(**actor_options(res, max_concurrency=_ACTOR_CONCURRENCY))
    names = [f"r{i}" for i in range(cfg.replicas)]
    actors = [cls.remote() for _ in names]
    router = Router(max_sticky_sessions=cfg.max_sticky_sessions)
    try:
        refs = [a.start.remote(model.path, cfg.model_dump_json(), model.dtype, version, n) for a, n in zip(actors, names)]
        stats = await anyio.to_thread.run_sync(
            wait_started, refs, [f"engine replica {n}" for n in names], ray_cfg.actor_start_timeout_s, abandon_on_cancel=True
        )
        for actor, name, started in zip(actors, names, stats):
            await router.add_replica(RayEngine(actor, name, started), name)
            log.info("engine replica on ray", replica=name, node=started.extra.get("node"))
    except BaseException:
        with anyio.CancelScope(shield=True):
            await router.aclose()
            kill_actors(actors)  # those not yet handed to the router
        raise
    return router


@contextlib.asynccontextmanager
async def open_ray_engine(rollout: RolloutConfig, model: ModelConfig, ray_cfg: RayConfig, *, version: int = 0) -> AsyncIterator[Router]:
    router = await create_ray_engine(rollout, model, ray_cfg, version=version)
    try:
        yield router
    finally:
        with anyio.CancelScope(shield=True):
            await router.aclose()
