"""Building the rollout engine from config: ``replicas`` vLLM engines behind a ``Router``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio

from psrl.config.rollout import EngineConfig, ModelConfig, RolloutConfig, SamplingConfig

from .base import SamplingParams
from .router import Router
from .vllm_engine import VLLMEngine

_BUILT_TYPES = ("vllm",)


def _check_type(cfg: EngineConfig) -> None:
    if cfg.type not in _BUILT_TYPES:
        raise ValueError(
            f"rollout.engine.type {cfg.type!r} is not built from config; make_engine builds: {', '.join(_BUILT_TYPES)}"
            + (". A scripted engine is a psrl.testing.ScriptedEngine that tests construct and pass in." if cfg.type == "scripted" else "")
        )


def make_engine(rollout: RolloutConfig, model: ModelConfig, *, version: int = 0, lora_rank: int = 0) -> Router:
    """Start ``rollout.engine.replicas`` engines one after another (blocking) behind a Router.
    ``lora_rank`` > 0: they serve the trainer's LoRA adapters of that rank."""
    from psrl.models import resolve_model_path

    cfg = rollout.engine
    _check_type(cfg)
    path = resolve_model_path(model.path)
    engines: dict[str, VLLMEngine] = {}
    try:
        for i in range(cfg.replicas):
            engines[f"r{i}"] = VLLMEngine.launch(path, cfg, dtype=model.dtype, version=version, name=f"r{i}",
                                                lora_rank=lora_rank)
    except BaseException:
        for engine in engines.values():
            engine.close()
        raise
    return Router(engines, max_sticky_sessions=cfg.max_sticky_sessions)


async def create_engine(rollout: RolloutConfig, model: ModelConfig, *, version: int = 0, lora_rank: int = 0) -> Router:
    """``make_engine`` for async callers; the caller owns the Router and must ``aclose`` it."""
    from psrl.models import resolve_model_path

    cfg = rollout.engine
    _check_type(cfg)
    path = await anyio.to_thread.run_sync(resolve_model_path, model.path)  # may build an offline model
    router = Router(max_sticky_sessions=cfg.max_sticky_sessions)
    try:
        for i in range(cfg.replicas):
            engine = await VLLMEngine.create(path, cfg, dtype=model.dtype, version=version, name=f"r{i}", lora_rank=lora_rank)
            await router.add_replica(engine, f"r{i}")
    except BaseException:
        with anyio.CancelScope(shield=True):
            await router.aclose()
        raise
    return router


@contextlib.asynccontextmanager
async def open_engine(rollout: RolloutConfig, model: ModelConfig, *, version: int = 0, lora_rank: int = 0
                      ) -> AsyncIterator[Router]:
    router = await create_engine(rollout, model, version=version, lora_rank=lora_rank)
    try:
        yield router
    finally:
        with anyio.CancelScope(shield=True):
            await router.aclose()


def sampling_from_config(cfg: SamplingConfig, **overrides: object) -> SamplingParams:
    """The request sampling defaults from ``rollout.sampling`` (``n`` is the group size, not used here)."""
    values = dict(
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_tokens=cfg.max_tokens,
        stop=tuple(cfg.stop),
        stop_token_ids=tuple(cfg.stop_token_ids),
        seed=cfg.seed,
    )
    values.update(overrides)
    return SamplingParams(**values)  # type: ignore[arg-type]
