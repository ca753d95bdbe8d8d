import anyio
import numpy as np
import pytest

from psrl.engines import FinishReason, GenerateRequest, InferenceEngine, SamplingParams
from psrl.environments import Environment, Task
from psrl.testing import ByteAgentData, ConformanceError, CrashingEnv, EchoEnv, GuessNumberEnv, ScriptedEngine, check_environment

pytestmark = pytest.mark.anyio


async def test_scripted_engine_serves_script_with_versions_and_limits():
    engine = ScriptedEngine([[1, 2, 3], [4, 5, 6, 7, 8]], logprob=-0.25, vocab_size=100)
    assert isinstance(engine, InferenceEngine)
    r1 = await engine.generate(GenerateRequest(np.array([9]), SamplingParams(max_tokens=10)))
    np.testing.assert_array_equal(r1.output_ids, [1, 2, 3])
    assert r1.finish_reason == FinishReason.STOP and np.all(r1.logprobs == np.float32(-0.25))
    await engine.update_weights([("w", None)], version=3)
    r2 = await engine.generate(GenerateRequest(np.array([9]), SamplingParams(max_tokens=2)))
    np.testing.assert_array_equal(r2.output_ids, [4, 5])
    assert r2.finish_reason == FinishReason.LENGTH and list(r2.versions) == [3, 3]
    bad = await engine.generate(GenerateRequest(np.array([1000])))
    assert bad.finish_reason == FinishReason.ERROR and "outside" in bad.error
    neg = await engine.generate(GenerateRequest(np.array([1]), SamplingParams(max_tokens=0)))
    assert neg.finish_reason == FinishReason.ERROR and "max_tokens" in neg.error
    stats = engine.statistics()
    assert stats.version == 3 and stats.weight_updates == 1 and stats.requests_in_flight == 0


async def test_scripted_engine_pause_holds_requests_and_abort_ends_them():
    engine = ScriptedEngine(lambda req: [7], delay_s=0.05)
    results = {}
    await engine.pause()
    async with anyio.create_task_group() as tg:
        async def run(rid):
            results[rid] = await engine.generate(GenerateRequest(np.array([1]), request_id=rid))

        tg.start_soon(run, "a")
        tg.start_soon(run, "b")
        await anyio.sleep(0.1)
        assert not results and engine.statistics().paused
        await engine.resume()
        await anyio.sleep(0.01)
        await engine.abort("b")
    assert results["a"].finish_reason == FinishReason.STOP
    assert results["b"].finish_reason == FinishReason.ABORT and len(results["b"].output_ids) == 0


async def test_toy_envs_pass_conformance():
    task = Task(prompt="guess", ground_truth=5)
    await check_environment(GuessNumberEnv, task, ["3", "8", "5"], bad_actions=["not a number", ""])
    await check_environment(EchoEnv, Task(prompt="say hi", ground_truth="hi"), ["hi there"])
    assert isinstance(GuessNumberEnv(), Environment)


async def test_conformance_catches_a_crashing_env():
    with pytest.raises(RuntimeError, match="environment crashed"):
        await check_environment(CrashingEnv, Task(prompt="x"), ["a"])


async def test_conformance_catches_shared_state():
    shared = {"n": 0}

    class Leaky:
        async def reset(self, task):
            return "start", {}

        async def step(self, action):
            shared["n"] += 1
            return str(shared["n"]), 0.0, False, {}

        async def aclose(self):
            pass

    with pytest.raises(ConformanceError):
        await check_environment(Leaky, Task(prompt="x"), ["a", "b"])


def test_byte_agent_data_round_trip():
    codec = ByteAgentData(prefix="\n> ")
    ids = codec.obs_to_tokens("héllo", first=True)
    assert ids.dtype == np.int32 and codec.tokens_to_action(ids) == "héllo"
    assert codec.decode(codec.obs_to_tokens("x", first=False)) == "\n> x"
