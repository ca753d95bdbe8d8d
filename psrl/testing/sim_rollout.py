"""A SIMULATED environment and group rollout whose timings follow a ``LatencyModel``.

``SimulatedEnv`` is a real ``Environment`` (it passes ``check_environment``): its episode length
and step latency come from the model, its reward is a seeded coin. ``SimulatedRollout`` plays the
part of the agent loop for the pipeline benchmark: n episodes of one row, concurrently, through
whatever ``InferenceEngine`` it is given, each a multi-turn token-in/token-out trajectory.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import anyio
import numpy as np

from psrl.engines.base import FinishReason, GenerateRequest, InferenceEngine, SamplingParams
from psrl.environments.base import Task
from psrl.trajectory import Status, Step, Trajectory

from .latency_model import LatencyModel


class SimulatedEnv:
    """Turns and rewards are drawn from a seed derived from the task, so replays are identical."""

    def __init__(self, model: LatencyModel, *, reward_p: float = 0.5) -> None:
        self.model, self.reward_p = model, reward_p
        self._rng: np.random.Generator | None = None
        self._turns_left = 0
        self.closed = False

    async def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        seed = zlib.crc32(repr((task.prompt, task.extra_info.get("episode", 0))).encode())
        self._rng = np.random.default_rng(seed)
        self._turns_left = self.model.draw_turns(self._rng)
        return str(task.prompt), {}

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self._rng is None:
            raise RuntimeError("step() before reset()")
        self._turns_left -= 1
        if self._turns_left <= 0:
            return "", float(self._rng.random() < self.reward_p), True, {}
        delay = self.model.draw_env_s(self._rng)
        if self._rng.random() < self.model.failure_rate:
            raise RuntimeError("simulated environment failure")
        await anyio.sleep(delay * self.model.time_scale)
        return "o" * self.model.obs_tokens, 0.0, False, {"metrics": {"env_time_s": delay}}

    async def aclose(self) -> None:
        self.closed = True


class SimulatedRollout:
    """Implements the pipeline's ``GroupRollout``: each episode is prompt -> (generate -> env
    step)* -> Trajectory, with one byte per token; an env exception makes a FAILED trajectory."""

    def __init__(self, model: LatencyModel, *, reward_p: float = 0.5) -> None:
        self.model, self.reward_p = model, reward_p

    async def run_group(
        self, row: Mapping[str, Any], *, group_id: str, n: int, engine: InferenceEngine, validation: bool
    ) -> list[Trajectory]:
        out: list[Trajectory | None] = [None] * n

        async def one(i: int) -> None:
            out[i] = await self._episode(row, f"{group_id}-{i}", group_id, i, engine)

        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
        return [t for t in out if t is not None]

    async def _episode(self, row: Mapping[str, Any], key: str, group_id: str, i: int, engine: InferenceEngine) -> Trajectory:
        env = SimulatedEnv(self.model, reward_p=self.reward_p)
        prompt_text = str(row.get("prompt", "task"))
        prompt = np.frombuffer(prompt_text.encode()[: self.model.prompt_tokens].ljust(self.model.prompt_tokens), np.uint8).astype(np.int32)
        steps: list[Step] = []
        context = prompt
        env_time = 0.0
        try:
            await env.reset(Task(prompt=prompt_text, extra_info={"episode": i}))
            while True:
                res = await engine.generate(GenerateRequest(context, SamplingParams(max_tokens=self.model.max_tokens), session_id=key))
                if res.finish_reason == FinishReason.ERROR:
                    raise RuntimeError(f"engine error: {res.error}")
                obs, reward, done, info = await env.step("x")
                env_time += float(info.get("metrics", {}).get("env_time_s", 0.0))
                obs_ids = np.full(len(obs), ord("o"), np.int32)
                steps.append(Step(res.output_ids, res.logprobs, res.versions, obs_ids, reward, done))
                context = np.concatenate([context, res.output_ids, obs_ids])
                if done:
                    break
            if self.model.episode_overhead_s > 0:  # reset, reward, tokenization, the trip to the trainer
                await anyio.sleep(self.model.episode_overhead_s * self.model.time_scale)
            status, error = Status.OK, None
        except Exception as e:  # noqa: BLE001 - an episode failure is data, not a crash
            status, error = Status.FAILED, f"{type(e).__name__}: {e}"
        finally:
            with anyio.CancelScope(shield=True):
                await env.aclose()
        return Trajectory.from_steps(
            key, group_id, prompt, steps, status=status, error=error, env_metrics={"env_time_s": env_time}
        )
