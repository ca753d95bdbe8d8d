"""Translating PSRL config and requests into vLLM's argument types (imports vLLM lazily)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psrl.config.rollout import EngineConfig

from .base import SamplingParams

if TYPE_CHECKING:
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs

WORKER_EXTENSION = "psrl.engines.worker_ext.WeightUpdateExtension"


# vLLM's max_lora_rank values (LoRAConfig.max_lora_rank)
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_args(rank: int) -> dict[str, Any]:
    """vLLM's settings to serve the trainer's adapters of ``rank``. Requests name the newest
    adapter; one submitted just before a sync may still name the previous one, so two run in a
    batch, and the worker keeps the newest ``KEPT_ADAPTERS`` (plus one while the next loads)."""
    from .worker_ext import KEPT_ADAPTERS

    fits = [r for r in _LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"trainer.lora.rank={rank}: vLLM serves adapters of rank {_LORA_RANKS[-1]} at most")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 2, "max_cpu_loras": KEPT_ADAPTERS + 1}


def engine_args(cfg: EngineConfig, model_path: str, dtype: str, *, lora_rank: int = 0) -> AsyncEngineArgs:
    """``AsyncEngineArgs`` for one replica. ``cfg.engine_kwargs`` pass through to vLLM unchanged.
    ``lora_rank`` > 0: the replica serves the trainer's LoRA adapters (``lora_args``)."""
    # vLLM's internal queues bind the machine's outward address unless told otherwise; PSRL keeps
    # all traffic on loopback unless the user chose an address.
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform

    kwargs: dict[str, Any] = dict(
        model=model_path,
        dtype=dtype,
        max_model_len=cfg.max_model_len,
        enforce_eager=cfg.enforce_eager,
        max_num_seqs=cfg.max_num_seqs,
        seed=cfg.seed,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        enable_prefix_caching=cfg.enable_prefix_caching,
        tensor_parallel_size=cfg.tensor_parallel_size,
        worker_extension_cls=WORKER_EXTENSION,
        disable_log_stats=True,
        use_tqdm_on_load=os.environ.get("PSRL_LOG_LEVEL", "").upper() == "DEBUG",  # quiet unless -v (psrl.log)
    )
    if current_platform.is_cpu():
        check_cpu_head_size(model_path)
        # On CPU the KV cache is sized in bytes (VLLM_CPU_KVCACHE_SPACE, if set, still wins).
        kwargs["kv_cache_memory_bytes"] = int(cfg.cpu_kv_cache_gb * (1 << 30))
        # A seeded request (rollout.sampling.seed, or an agent's OpenAI `seed`) whose prompt is
        # prefilled in chunks kills vLLM's CPU engine: it rewinds the request's generator with
        # set_offset, which CPU generators do not have ("CPU Generator does not use offset",
        # vLLM 0.32). Whole-prompt prefill never rewinds.
        kwargs["enable_chunked_prefill"] = False
    if lora_rank:
        kwargs.update(lora_args(lora_rank))
    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    unknown = sorted(set(cfg.engine_kwargs) - known)
    if unknown:
        raise ValueError(f"rollout.engine.engine_kwargs has keys vLLM's AsyncEngineArgs does not know: {unknown}")
    kwargs.update(cfg.engine_kwargs)
    return AsyncEngineArgs(**kwargs)


def check_cpu_head_size(model_path: str) -> None:
    """Fail fast, naming the cause, on a model vLLM's CPU attention cannot run.

    Without this, the engine dies after start-up with "Unsupported CPU attention configuration".
    """
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    config = config.get("text_config", config)
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (config["hidden_size"] // heads if heads and "hidden_size" in config else None)
    if head_dim is None:
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise ValueError(
            f"model {model_path} has attention head size {head_dim}; vLLM on CPU supports head sizes {supported}"
        )


def sampling_params(s: SamplingParams, max_tokens: int) -> vllm.SamplingParams:
    """vLLM sampling params streaming token deltas with the sampled token's log-prob.

    Raises vLLM's validation error (a ``ValueError``) for values it refuses.
    """
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VllmSamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        max_tokens=max_tokens,
        stop=list(s.stop) or None,
        stop_token_ids=list(s.stop_token_ids) or None,
        seed=s.seed,
        logprobs=0 if s.logprobs else None,  # 0: only the sampled token's log-prob
        flat_logprobs=True,
        detokenize=bool(s.stop),  # text is only needed to match stop strings
        output_kind=RequestOutputKind.DELTA,
    )


def sampled_logprobs(token_ids: list[int], logprobs: Any) -> list[float]:
    """The log-prob of each sampled token from a (flat or per-position dict) vLLM logprobs delta."""
    if logprobs is None:
        return [float("nan")] * len(token_ids)
    flat = getattr(logprobs, "logprobs", None)
    starts = getattr(logprobs, "start_indices", None)
    if flat is not None and starts is not None:
        # FlatLogprobs: with logprobs=0 each position holds one entry, the sampled token.
        if len(flat) == len(token_ids):
            return list(flat)
        ids = logprobs.token_ids
        out = []
        for pos, tok in enumerate(token_ids):
            lo, hi = starts[pos], logprobs.end_indices[pos]
            out.append(next((flat[i] for i in range(lo, hi) if ids[i] == tok), float("nan")))
        return out
    return [float(pos[tok].logprob) if pos and tok in pos else float("nan") for tok, pos in zip(token_ids, logprobs)]
