"""A real vLLM engine serving the trainer's LoRA adapters: each version's adapter is synced as
adapter tensors only (no base weight travels), built in the engine's worker in memory, named by
every request from then on; the engine samples with the trainer's log-probs, every token carries
the version it was sampled at; an engine started without LoRA refuses an adapter by name and
serves on."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from psrl.config import AlgorithmConfig, LoraConfig, OptimConfig, TrainerConfig, WeightSyncConfig
from psrl.engines import FinishReason, GenerateRequest, SamplingParams
from psrl.models import model_dir
from psrl.trajectory import Step, Trajectory

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
pytestmark = [pytest.mark.timeout(300), pytest.mark.anyio]
RANK = 8


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _trajectories(n=6, vocab=800, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        r = rng.integers(0, vocab, 6 + i)
        out.append(Trajectory(key=f"k{i}", group_id=f"g{i // 3}", prompt_ids=rng.integers(0, vocab, 4 + i), response_ids=r,
                              loss_mask=np.ones(len(r), np.int8), logprobs=np.full(len(r), -6.0, np.float32),
                              versions=np.zeros(len(r), np.int64), turn_bounds=[[0, len(r)]], turn_rewards=[float(i % 2)],
                              reward=float(i % 2)))
    return out


async def _sample(engine, prompts, seed=0):
    out = []
    for i, p in enumerate(prompts):
        res = await engine.generate(GenerateRequest(p, SamplingParams(temperature=1.0, max_tokens=12, seed=seed + i)))
        assert res.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), res.error
        out.append(res)
    return out


async def test_engine_serves_each_synced_adapter_with_the_trainers_logprobs():
    from psrl.config.rollout import EngineConfig
    from psrl.engines.vllm_engine import VLLMEngine
    from psrl.trainer.trainer import MegatronTrainer
    from psrl.trainer.weight_sync import DirectPublisher

    path = str(model_dir("tiny-qwen2"))
    cfg = TrainerConfig(device="cpu", optim=OptimConfig(lr=1e-2), lora=LoraConfig(rank=RANK, init="gaussian"))
    prompts = [np.random.default_rng(7).integers(0, 800, n).astype(np.int32) for n in (5, 9, 14)]
    async with VLLMEngine.open(path, EngineConfig(max_model_len=256, cpu_kv_cache_gb=0.25, max_num_seqs=4),
                               dtype="float32", lora_rank=RANK) as engine:
        with MegatronTrainer(path, cfg, AlgorithmConfig()) as tr:
            publisher = DirectPublisher(engine, WeightSyncConfig())
            full_bytes = sum(t.numel() * 4 for _, t in tr.hf_state_dict().items())
            try:
                for version in (1, 2):  # the second replaces the first
                    for _ in range(2):
                        tr.step(_trajectories())
                    adapter = list(tr.hf_weights())
                    assert all(".lora_A." in n or ".lora_B." in n for n, _ in adapter)
                    report = await publisher.publish(adapter, version, adapter=tr.adapter_config())
                    assert report.bytes == sum(t.numel() * t.element_size() for _, t in adapter) < full_bytes / 5  # tiny: hidden 64
                    stats = engine.statistics()
                    assert stats.version == version and stats.extra["adapter"] == f"psrl-v{version}"
                    results = await _sample(engine, prompts, seed=version)
                    trajs = [Trajectory.from_steps(f"r{i}", f"g{i}", p, [Step(r.output_ids, r.logprobs, r.versions)])
                             for i, (p, r) in enumerate(zip(prompts, results))]
                    assert all((r.versions == version).all() for r in results)
                    engine_lp = np.concatenate([t.logprobs for t in trajs])
                    ours = np.concatenate(tr.compute_logprobs(trajs))
                    base = np.concatenate(tr.compute_logprobs(trajs, reference=True))
                    assert np.abs(engine_lp - ours).mean() < 1e-4 and np.abs(engine_lp - ours).max() < 1e-3
                    assert np.abs(engine_lp - base).mean() > 1e-2  # the adapter is what the engine serves
            finally:
                await publisher.aclose()


async def test_an_engine_without_lora_refuses_an_adapter_and_serves_on(vllm_engine):
    """The shared engine (started without LoRA) gets an adapter: the sync fails naming the cause,
    the engine keeps its version and serves."""
    from psrl.engines.weight_transfer import WeightTransferError
    from psrl.trainer.trainer import MegatronTrainer
    from psrl.trainer.weight_sync import DirectPublisher

    path = str(model_dir("tiny-qwen2"))
    before = vllm_engine.statistics().version
    with MegatronTrainer(path, TrainerConfig(device="cpu", lora=LoraConfig(rank=RANK))) as tr:
        publisher = DirectPublisher(vllm_engine, WeightSyncConfig(retries=0))
        try:
            with pytest.raises(WeightTransferError, match="serves no LoRA adapters"):
                await publisher.publish(list(tr.hf_weights()), before + 1, adapter=tr.adapter_config())
        finally:
            await publisher.aclose()
    assert vllm_engine.statistics().version == before
    (res,) = await _sample(vllm_engine, [np.arange(3, 9, dtype=np.int32)])
    assert len(res.output_ids) and (res.versions == before).all()
