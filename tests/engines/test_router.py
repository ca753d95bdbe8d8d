"""Router over the shared real vLLM engine plus ScriptedEngine replicas.

The routing logic is engine-agnostic; a ScriptedEngine (the public fake) as the second replica
keeps these tests on one vLLM engine. tests/engines/test_two_replicas_slow.py runs two real ones
(one killed, its sessions move to the other).
"""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import torch

from psrl.engines import FinishReason, GenerateRequest, InferenceEngine, Router, SamplingParams
from psrl.testing import ScriptedEngine

from .test_vllm_engine import GREEDY, PROMPTS, generate_all, perturbed

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


def counting_script(req: GenerateRequest) -> list[int]:
    # One token more than allowed, so the ScriptedEngine cuts it and reports LENGTH like vLLM.
    return list(range(10, 11 + req.sampling.max_tokens))


async def test_passes_requests_and_bad_input_through(vllm_engine):
    router = Router({"vllm": vllm_engine}, close_replicas=False)
    assert isinstance(router, InferenceEngine)
    direct = await vllm_engine.generate(GenerateRequest(PROMPTS[0], GREEDY))
    routed = await router.generate(GenerateRequest(PROMPTS[0], GREEDY))
    np.testing.assert_array_equal(routed.output_ids, direct.output_ids)
    np.testing.assert_array_equal(routed.logprobs, direct.logprobs)
    assert routed.first_token_s is not None and routed.first_token_s > 0, "the replica's time to first token passes through"
    bad = await router.generate(GenerateRequest(np.array([1, 10**6]), GREEDY))
    assert bad.finish_reason is FinishReason.ERROR and "outside the vocabulary" in bad.error
    assert list(router.replicas) == ["vllm"], "a bad request is not a failed replica"
    stats = router.statistics()
    assert stats.requests_done == 2 and stats.tokens_generated == GREEDY.max_tokens
    assert stats.extra["replicas"]["vllm"].version == vllm_engine.statistics().version
    await router.aclose()
    assert vllm_engine.is_alive(), "close_replicas=False leaves shared engines running"


async def test_sessions_stick_and_the_rest_goes_to_the_least_loaded(vllm_engine):
    scripted = ScriptedEngine(counting_script, delay_s=0.05)
    router = Router({"vllm": vllm_engine, "scripted": scripted}, close_replicas=False)
    sessions = [f"s{i}" for i in range(4)]

    async def chat(session: str) -> None:
        prompt = PROMPTS[1]
        for _ in range(3):  # multi-turn: each turn extends the previous prompt + output
            res = await router.generate(GenerateRequest(prompt, SamplingParams(temperature=0.0, max_tokens=5), session_id=session))
            assert res.finish_reason is FinishReason.LENGTH, res.error
            prompt = np.concatenate([prompt, res.output_ids, [7]])

    async with anyio.create_task_group() as tg:
        for s in sessions:
            tg.start_soon(chat, s)
    pinned = {s: router.session_replica(s) for s in sessions}
    assert sorted(pinned.values()) == ["scripted", "scripted", "vllm", "vllm"], pinned
    by_scripted = [r.session_id for r in scripted.requests]
    for s in sessions:
        assert by_scripted.count(s) == (3 if pinned[s] == "scripted" else 0), (s, by_scripted)

    # Without a session: the replica with fewer requests in flight, so a slow one gets fewer.
    slow = ScriptedEngine(counting_script, delay_s=0.5)
    await router.remove_replica("scripted")
    await router.add_replica(slow, "slow")
    with anyio.fail_after(30):
        results = await generate_all(router, [GenerateRequest(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4)) for _ in range(6)])
    assert all(r.finish_reason is FinishReason.LENGTH for r in results)
    assert len(slow.requests) == 3, "6 requests submitted at once alternate between idle replicas"
    later = await generate_all(router, [GenerateRequest(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4)) for _ in range(2)])
    assert all(r.finish_reason is FinishReason.LENGTH for r in later)
    await router.aclose()


async def test_replica_removed_mid_run_continues_elsewhere_from_its_tokens(vllm_engine, reference):
    router = Router({"vllm": vllm_engine}, close_replicas=False)
    req = GenerateRequest(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=900), session_id="long")
    results = []

    async def run():
        results.append(await router.generate(req))

    scripted = ScriptedEngine(counting_script)
    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await anyio.sleep(0.3)
        assert router.statistics().extra["in_flight_per_replica"] == {"vllm": 1}
        await router.add_replica(scripted, "scripted")
        removed = await router.remove_replica("vllm")
        assert removed is vllm_engine and vllm_engine.is_alive()
    (res,) = results
    assert res.finish_reason is FinishReason.LENGTH and len(res.output_ids) == 900
    (continued,) = scripted.requests
    n_vllm = len(continued.prompt_ids) - len(PROMPTS[0])
    assert 0 < n_vllm < 900
    np.testing.assert_array_equal(continued.prompt_ids, np.concatenate([PROMPTS[0], res.output_ids[:n_vllm]]))
    assert continued.sampling.max_tokens == 900 - n_vllm and continued.session_id == "long"
    assert res.output_ids[n_vllm:].tolist() == counting_script(continued)[: 900 - n_vllm]
    from .reference import rescore

    checked = min(n_vllm, 40)  # the tokens vLLM produced before the replica was removed
    np.testing.assert_allclose(res.logprobs[:checked], rescore(reference, PROMPTS[0], res.output_ids[:checked]), atol=1e-4)
    assert (res.logprobs[n_vllm:] == np.float32(-0.5)).all()
    assert router.session_replica("long") == "scripted" and list(router.replicas) == ["scripted"]
    assert router.statistics().extra["migrations"] == 1
    with pytest.raises(KeyError, match="no replica named 'vllm'"):
        await router.remove_replica("vllm")
    await router.aclose()


@pytest.fixture(scope="module")
def reference(vllm_model_path):
    from .reference import load_reference

    return load_reference(vllm_model_path)


def broken_script(req: GenerateRequest) -> list[int]:
    raise RuntimeError("replica lost its accelerator")


async def test_a_failing_replica_is_taken_out_and_its_requests_continue(vllm_engine):
    broken = ScriptedEngine(broken_script)
    router = Router({"broken": broken, "vllm": vllm_engine}, close_replicas=False)
    results = await generate_all(router, [GenerateRequest(p, GREEDY) for p in PROMPTS])
    assert broken.requests, "the broken replica was tried"
    for prompt, res in zip(PROMPTS, results):
        assert res.finish_reason is FinishReason.LENGTH and len(res.output_ids) == GREEDY.max_tokens, res.error
    failed = router.statistics().extra["failed_replicas"]
    assert list(failed) == ["broken"] and "replica lost its accelerator" in failed["broken"]
    assert list(router.replicas) == ["vllm"]
    await router.aclose()


async def test_no_live_replica_left_is_an_error_result():
    router = Router({"broken": ScriptedEngine(broken_script)})
    res = await router.generate(GenerateRequest(PROMPTS[0], GREEDY))
    assert res.finish_reason is FinishReason.ERROR
    assert "no live replica" in res.error and "replica lost its accelerator" in res.error
    assert (await router.generate(GenerateRequest(PROMPTS[0], GREEDY))).finish_reason is FinishReason.ERROR
    await router.aclose()
    empty = Router()
    assert "no live replica" in (await empty.generate(GenerateRequest(PROMPTS[0], GREEDY))).error


async def test_abort_pause_resume_and_weight_updates_reach_every_replica(
    vllm_engine, vllm_original_weights, restore_vllm_weights
):
    scripted = ScriptedEngine(counting_script, delay_s=0.2)
    router = Router({"vllm": vllm_engine, "scripted": scripted}, close_replicas=False)
    long = GenerateRequest(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=900), session_id="x")
    results = []

    async def run(req):
        results.append(await router.generate(req))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, long)
        await anyio.sleep(0.3)
        await router.abort(long.request_id)
    assert results[0].finish_reason is FinishReason.ABORT and 0 < len(results[0].output_ids) < 900
    assert router.statistics().extra["migrations"] == 0, "an abort is not a migration"

    version = router.statistics().version
    await router.pause()
    assert vllm_engine.statistics().paused and scripted.statistics().paused
    await router.update_weights(perturbed(vllm_original_weights, seed=3).items(), version + 1)
    assert router.statistics().paused, "an update keeps an explicit pause"
    await router.resume()
    assert vllm_engine.statistics().version == scripted.version == router.statistics().version == version + 1
    res = await router.generate(GenerateRequest(PROMPTS[1], GREEDY))
    assert (res.versions == version + 1).all()

    with pytest.raises(ValueError, match="replica vllm: weight update refused"):
        await router.update_weights([("model.norm.weight", torch.zeros(64))], version + 2)
    assert list(router.replicas) == ["vllm", "scripted"], "bad weights are not a failed replica"
    assert vllm_engine.statistics().version == version + 1
    await router.aclose()


class _UncloseableEngine(ScriptedEngine):
    """A replica whose generate fails and whose close fails too (a crashed accelerator)."""

    async def aclose(self) -> None:
        raise RuntimeError("device handle is gone")


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_replica_that_cannot_close_is_logged_and_retried_at_aclose():
    from structlog.testing import capture_logs

    broken = _UncloseableEngine(broken_script)
    backup = ScriptedEngine(counting_script)
    router = Router({"broken": broken, "backup": backup})  # owns them: closes a failed replica
    with capture_logs() as logs:
        res = await router.generate(GenerateRequest(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3)))
    assert res.finish_reason is FinishReason.LENGTH and list(router.replicas) == ["backup"]
    warned = [e for e in logs if e["log_level"] == "warning"]
    assert len(warned) == 1 and warned[0]["replica"] == "broken" and "device handle is gone" in warned[0]["error"]
    with pytest.raises(RuntimeError, match="device handle is gone"):  # retried, and its error surfaces
        await router.aclose()
