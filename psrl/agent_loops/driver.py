"""The one generic episode driver behind every built-in agent loop.

env.reset -> AgentData.obs_to_tokens(first) -> engine.generate -> AgentData.tokens_to_action
-> env.step -> AgentData.obs_to_tokens -> engine.generate ... until the env says done, the turn
limit, the response-length budget, or the episode timeout. It knows nothing about the task.

The context sent to the engine is always ``prompt + turn_1 + obs_1 + ... + turn_k``: the model's
own tokens and the observation tokens exactly as they were produced, never re-tokenized text.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio
import numpy as np

from psrl.engines import FinishReason, GenerateRequest, GenerateResult, InferenceEngine
from psrl.environments import Task
from psrl.trajectory import Status, Step, Trajectory

from .base import EpisodeContext

_EMPTY = np.zeros(0, np.int32)
_ERROR, _ABORT = FinishReason.ERROR, FinishReason.ABORT
ABORT_GRACE_S = 5.0  # how long a cancelled episode waits for the engine to drop its request
CLOSE_GRACE_S = 30.0  # how long a finished episode waits for env.aclose()


async def generate_or_abort(engine: InferenceEngine, request: GenerateRequest) -> GenerateResult:
    """``engine.generate`` that, when cancelled (batch cancel, episode timeout), tells the engine
    to drop the request before the cancellation goes on: no request outlives its episode.
    For custom loops; :func:`run_episode` inlines the same on its hot path."""
    try:
        return await engine.generate(request)
    except BaseException:
        with anyio.move_on_after(ABORT_GRACE_S, shield=True):
            await engine.abort(request.request_id)
        raise


def _add_metrics(into: dict[str, float], info: Any) -> None:
    metrics = info.get("metrics") if isinstance(info, dict) else None
    if metrics:
        for k, v in metrics.items():
            into[k] = into.get(k, 0.0) + float(v)


def _join(error: str | None, more: str) -> str:
    return f"{error}; {more}" if error else more


async def run_episode(ctx: EpisodeContext, task: Task, *, max_turns: int) -> Trajectory:
    """Run one episode to a Trajectory. Env/engine/codec exceptions and the episode timeout give
    status FAILED with the error (and keep the turns done so far); cancellation propagates after
    the env is closed and the engine request aborted.

    One flat coroutine on purpose: every extra await level is paid on each resume of every one
    of thousands of concurrent episodes (see ``psrl bench agent-loop``).
    """
    env, data, engine, mt, sampling, key = ctx.env, ctx.agent_data, ctx.engine, ctx.multi_turn, ctx.sampling, ctx.key
    prompt_ids = _EMPTY
    steps: list[Step] = []
    metrics: dict[str, float] = {}
    status, error = Status.TRUNCATED, None  # what running out of turns means
    stage = "env.reset"
    try:
        with anyio.move_on_after(mt.episode_timeout_s) as timeout:
            obs, info = await env.reset(task)
            _add_metrics(metrics, info)
            stage = "agent_data.obs_to_tokens"
            prompt_ids = context = np.asarray(data.obs_to_tokens(obs, first=True), np.int32)
            if ctx.max_prompt_length is not None and len(context) > ctx.max_prompt_length:
                max_turns = 0
                status = Status.FAILED
                error = f"prompt has {len(context)} tokens, more than the limit of {ctx.max_prompt_length} (data.max_prompt_length)"
            budget = mt.max_response_length
            used = 0
            for turn in range(max_turns):
                left = budget - used
                if left <= 0:
                    break  # TRUNCATED
                stage = "engine.generate"
                request = GenerateRequest(
                    context, sampling if sampling.max_tokens <= left else dataclasses.replace(sampling, max_tokens=left), session_id=key
                )
                try:  # generate_or_abort, inlined: this is the hot path of every turn
                    result = await engine.generate(request)
                except BaseException:
                    with anyio.move_on_after(ABORT_GRACE_S, shield=True):
                        await engine.abort(request.request_id)
                    raise
                if result.finish_reason == _ERROR:
                    status, error = Status.FAILED, f"engine error on turn {turn + 1}: {result.error}"
                    break
                out = result.output_ids
                step = Step(out, result.logprobs, result.versions)
                steps.append(step)
                used += len(out)
                if result.finish_reason == _ABORT:
                    status, error = Status.FAILED, f"generation of turn {turn + 1} was aborted by the engine"
                    break
                stage = "agent_data.tokens_to_action"
                action = data.tokens_to_action(out)
                stage = "env.step"
                obs, reward, done, info = await env.step(action)
                step.reward = float(reward)
                turn_metrics = info.get("metrics") if info else None  # _add_metrics, inlined: hot path
                if turn_metrics:
                    for k, v in turn_metrics.items():
                        metrics[k] = metrics.get(k, 0.0) + float(v)
                if done:
                    step.done = True
                    status = Status.OK
                    break
                if turn == max_turns - 1:
                    break  # TRUNCATED: out of turns; the last observation is not needed
                stage = "agent_data.obs_to_tokens"
                obs_ids = np.asarray(data.obs_to_tokens(obs, first=False), np.int32)
                if used + len(obs_ids) >= budget:
                    break  # TRUNCATED: no room for the observation and another turn
                step.obs_ids = obs_ids
                used += len(obs_ids)
                context = np.concatenate((context, out, obs_ids))
        if timeout.cancelled_caught:
            status, error = Status.FAILED, f"episode timed out after {mt.episode_timeout_s:g} s (in {stage})"
    except Exception as e:  # noqa: BLE001 - the trajectory records it; cancellation is not an Exception
        status, error = Status.FAILED, f"{stage} raised {type(e).__name__}: {e}"
    finally:
        with anyio.move_on_after(CLOSE_GRACE_S, shield=True) as close_scope:
            try:
                await env.aclose()
            except Exception as e:  # noqa: BLE001
                status, error = Status.FAILED, _join(error, f"env.aclose raised {type(e).__name__}: {e}")
        if close_scope.cancelled_caught:
            status, error = Status.FAILED, _join(error, f"env.aclose did not finish in {CLOSE_GRACE_S:g} s")
    return Trajectory.from_steps(
        ctx.key, ctx.group_id, prompt_ids, steps,
        status=status, error=error, env_metrics=metrics, data_source=task.data_source,
    )
