"""The environment-bound task of ``psrl bench pipeline --real-rollout-workers``: every turn but
the last runs a real sandboxed ``code_interpreter`` call that takes ``work_s``; the last is graded."""

from __future__ import annotations

import time

import pytest

from benchmarks.pipeline_ray import SandboxedWorkEnv
from psrl.config.sandbox import SandboxConfig
from psrl.environments import Task
from psrl.sandboxes.pool import SandboxPool

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_each_turn_but_the_last_waits_in_the_sandbox():
    cfg = SandboxConfig()
    async with SandboxPool(cfg.spec, cfg.pool) as pool:
        env = SandboxedWorkEnv(sandbox_pool=pool, work_s=0.3, turns=2)
        try:
            await env.reset(Task(prompt=[{"role": "user", "content": "How many?"}], ground_truth="a digit"))
            t0 = time.perf_counter()
            obs, reward, done, info = await env.step("no tool call here")
            assert time.perf_counter() - t0 >= 0.3 and not done and reward == 0.0
            assert info["metrics"]["tool_calls"] == 1.0 and not info["metrics"].get("tool_exec_errors")
            assert "7" in str(obs.messages[-1]["content"])
            _, reward, done, _ = await env.step("It is 4.")
            assert done and reward == 1.0
        finally:
            await env.aclose()
