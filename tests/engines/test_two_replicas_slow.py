"""Two real vLLM replicas behind the Router; one is killed (its engine-core process) while its
sessions are mid-chat: they move to the other replica, a request in flight continues there from
the tokens it already had, and the result equals an uninterrupted greedy run.

Slow: it starts two vLLM engines of its own (~20-40 s each here), built by ``open_engine``.
"""

from __future__ import annotations

import os
import signal

import anyio
import numpy as np
import pytest

from psrl.config import EngineConfig, ModelConfig, RolloutConfig
from psrl.engines import FinishReason, GenerateRequest, SamplingParams, open_engine

pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.timeout(420)]

TURN = SamplingParams(temperature=0.0, max_tokens=8)
LONG = SamplingParams(temperature=0.0, max_tokens=600)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_killed_replica_hands_its_sessions_to_the_live_one(vllm_model_path):
    rollout = RolloutConfig(engine=EngineConfig(replicas=2, max_model_len=1024, cpu_kv_cache_gb=0.5))
    sessions = [f"s{i}" for i in range(4)]
    prompts = {s: np.arange(5 + i, 25 + i) for i, s in enumerate(sessions)}
    async with open_engine(rollout, ModelConfig(path=vllm_model_path, dtype="float32")) as router:
        assert sorted(router.replicas) == ["r0", "r1"]

        async def turn(s: str, params: SamplingParams = TURN):
            res = await router.generate(GenerateRequest(prompts[s], params, session_id=s))
            assert res.error is None and res.finish_reason is FinishReason.LENGTH, res.error
            prompts[s] = np.concatenate([prompts[s], res.output_ids, [7]])
            return res

        async with anyio.create_task_group() as tg:  # first turns at once: the sessions spread
            for s in sessions:
                tg.start_soon(turn, s)
        pinned = {s: router.session_replica(s) for s in sessions}
        assert sorted(pinned.values()) == ["r0", "r0", "r1", "r1"], pinned
        doomed_name = pinned["s0"]
        survivor_name = "r1" if doomed_name == "r0" else "r0"
        doomed, survivor = router.replicas[doomed_name], router.replicas[survivor_name]
        # vLLM internals, test only: the engine-core process to kill.
        core_pid = doomed.llm.engine_core.resources.engine_manager.processes[0].pid

        long_prompt = prompts["s0"].copy()
        results = []

        async def long_turn():
            results.append(await turn("s0", LONG))

        async with anyio.create_task_group() as tg:
            tg.start_soon(long_turn)
            await anyio.sleep(0.5)  # mid-generation on the doomed replica
            os.kill(core_pid, signal.SIGKILL)
        (res,) = results
        assert len(res.output_ids) == LONG.max_tokens
        # greedy on the same weights: the survivor's own uninterrupted run gives the same tokens
        fresh = await survivor.generate(GenerateRequest(long_prompt, LONG))
        np.testing.assert_array_equal(res.output_ids, fresh.output_ids)

        failed = router.statistics().extra["failed_replicas"]
        assert list(failed) == [doomed_name], failed
        assert list(router.replicas) == [survivor_name] and not doomed.is_alive()
        async with anyio.create_task_group() as tg:  # every session goes on, on the survivor
            for s in sessions:
                tg.start_soon(turn, s)
        assert {router.session_replica(s) for s in sessions} == {survivor_name}
