"""A real vLLM replica dies mid-generation (its engine-core process is killed): the Router takes
it out and the request continues on another replica from the tokens it already produced.

Slow: it starts a vLLM engine of its own (~20 s), built by ``open_engine`` from config.
"""

from __future__ import annotations

import os
import signal

import anyio
import numpy as np
import pytest

from psrl.config import EngineConfig, ModelConfig, RolloutConfig
from psrl.engines import FinishReason, GenerateRequest, SamplingParams, open_engine
from psrl.testing import ScriptedEngine

from .reference import load_reference, rescore
from .test_router import counting_script

pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_replica_killed_mid_generation_fails_over_with_its_tokens(vllm_model_path):
    rollout = RolloutConfig(engine=EngineConfig(replicas=1, max_model_len=1024, cpu_kv_cache_gb=0.5))
    prompt = np.arange(5, 25)
    async with open_engine(rollout, ModelConfig(path=vllm_model_path, dtype="float32")) as router:
        doomed = router.replicas["r0"]
        # vLLM internals, test only: the engine-core process to kill.
        core_pid = doomed.llm.engine_core.resources.engine_manager.processes[0].pid
        backup = ScriptedEngine(counting_script)
        req = GenerateRequest(prompt, SamplingParams(temperature=0.0, max_tokens=900), session_id="s")
        results = []

        async def run():
            results.append(await router.generate(req))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await anyio.sleep(0.5)
            await router.add_replica(backup, "backup")
            os.kill(core_pid, signal.SIGKILL)
        (res,) = results
        assert res.finish_reason is FinishReason.LENGTH and len(res.output_ids) == 900, res.error
        (continued,) = backup.requests
        produced = len(continued.prompt_ids) - len(prompt)
        assert 0 < produced < 900
        np.testing.assert_array_equal(continued.prompt_ids[len(prompt) :], res.output_ids[:produced])
        assert continued.sampling.max_tokens == 900 - produced
        reference = load_reference(vllm_model_path)
        np.testing.assert_allclose(res.logprobs[:40], rescore(reference, prompt, res.output_ids[:40]), atol=1e-4)
        failed = router.statistics().extra["failed_replicas"]
        assert list(failed) == ["r0"] and "dead" in failed["r0"], failed
        assert not doomed.is_alive() and list(router.replicas) == ["backup"]
        assert router.session_replica("s") == "backup"
