"""``mini_swe_agent``: a black-box agent works on a SWE task through the session gateway.

The episode's environment (``mini_swe_env``) puts the task repository in a sandbox; the agent
(built by ``mini_swe_agent_data``: the real mini-swe-agent or the built-in bash agent) gets a
gateway session -- an OpenAI base URL and bearer token -- and an ``execute`` that runs its
commands in that sandbox. Its model calls go to the episode's engine (the session id is the
Router's sticky key) and are captured token for token. When the agent stops, the environment
grades the workspace in a fresh sandbox, and the captured calls become the trajectory.

Limits: ``multi_turn.max_turns`` model calls (the call after the last one gets 410) and
``multi_turn.episode_timeout_s`` seconds. Either ends the episode with status TRUNCATED and the
reason in ``error``; the workspace is still graded and the sandbox released.
"""

from __future__ import annotations

import re
import secrets
from contextlib import asynccontextmanager
from typing import Any

import anyio

from psrl.environments import Task
from psrl.gateway import ChatTokenizer, Gateway, SessionCapture, open_gateway
from psrl.trajectory import Status, Trajectory

from .base import EpisodeContext

CLOSE_GRACE_S = 30.0
_EXIT_OK = {"Submitted"}
_EXIT_FORMAT = {"FormatErrors", "RepeatedFormatError", "FormatError"}


def _add_metrics(into: dict[str, float], info: Any) -> None:
    metrics = info.get("metrics") if isinstance(info, dict) else None
    for k, v in (metrics or {}).items():
        into[k] = into.get(k, 0.0) + float(v)


class MiniSWEAgentLoopV1:
    """One SWE episode with a black-box agent. ``gateway`` shares a running gateway between
    episodes (it must serve ``ctx.engine``); without one each episode serves its own on a free
    loopback port. After ``run``, ``trajectories`` holds every sample the calls merged into (the
    returned trajectory is the one with the most generated tokens; ``env_metrics["samples"]``
    says how many there were)."""

    observation_mode = "chat"

    def __init__(self, *, gateway: Gateway | None = None) -> None:
        self.gateway = gateway
        self.trajectories: list[Trajectory] = []
        self._metrics: dict[str, float] = {}  # summed step metrics of the running episode
        self._final: tuple[float, dict[str, Any]] | None = None  # (reward, info) of the grading step

    @asynccontextmanager
    async def _gateway(self, ctx: EpisodeContext):  # noqa: ANN202
        if self.gateway is not None:
            yield self.gateway
            return
        async with open_gateway(ctx.engine, ChatTokenizer(ctx.agent_data.tokenizer)) as gw:
            yield gw

    async def run(self, ctx: EpisodeContext, task: Task) -> Trajectory:
        metrics = self._metrics = {}
        self._final = None
        capture: SessionCapture | None = None
        status, error, reward = Status.OK, None, 0.0
        stage = "env.reset"
        try:
            _, info = await ctx.env.reset(task)
            stage = "agent_data.make_agent"
            agent = ctx.agent_data.make_agent(task.extra_info.get("agent"))
            stage = "gateway"
            async with self._gateway(ctx) as gw:
                capture, outcome, timed_out = await self._drive(ctx, gw, agent, info)
            metrics["model_calls"] = float(capture.num_calls)
            metrics["failed_model_calls"] = float(capture.failed_calls)
            stage = "grading"
            reward = await self._grade(ctx)
            status, error = self._status(ctx, capture, outcome, timed_out, metrics)
        except Exception as e:  # noqa: BLE001 - recorded on the trajectory, never raised out of the batch
            status, error = Status.FAILED, f"{stage} raised {type(e).__name__}: {e}"
        finally:
            with anyio.move_on_after(CLOSE_GRACE_S, shield=True) as scope:
                try:
                    await ctx.env.aclose()
                except Exception as e:  # noqa: BLE001
                    status, error = Status.FAILED, (f"{error}; " if error else "") + f"env.aclose raised {type(e).__name__}: {e}"
            if scope.cancelled_caught:
                status, error = Status.FAILED, (f"{error}; " if error else "") + f"env.aclose did not finish in {CLOSE_GRACE_S:g} s"
        return self._trajectory(ctx, task, capture, reward, status, error, metrics)

    async def _drive(self, ctx: EpisodeContext, gw: Gateway, agent: Any, info: dict[str, Any]):  # noqa: ANN202
        from psrl.environments.swe.actions import BashAction
        from psrl.environments.swe.agents import AgentOutcome, AgentRun, CommandOutcome

        mt = ctx.multi_turn
        sid = f"{re.sub(r'[^A-Za-z0-9_.-]', '.', ctx.key)}.{secrets.token_hex(3)}"
        session = gw.open_session(sid, sampling=ctx.sampling, lock_sampling=True, max_calls=mt.max_turns)
        ended: list[str] = []

        async def execute(command: str) -> CommandOutcome:
            if ended or self._final is not None:
                raise RuntimeError(f"the episode is over ({ended[0] if ended else 'submitted'}); no more commands run")
            _, reward, done, step_info = await ctx.env.step(BashAction(command))
            _add_metrics(self._metrics, step_info)
            if done:
                self._final = (float(reward), step_info)
            return CommandOutcome(
                output=step_info.get("output", ""), returncode=step_info.get("exit_code"),
                timed_out=bool(step_info.get("timed_out")), submitted=bool(done),
            )

        async def end_session(reason: str) -> None:
            if not ended:
                ended.append(reason)
            with anyio.CancelScope(shield=True):
                await gw.close_session(sid, reason)

        run = AgentRun(
            base_url=session.base_url, api_key=session.token, model=gw.model_name, task=info.get("issue", ""),
            execute=execute, max_steps=mt.max_turns, platform=info.get("platform", {}), end_session=end_session,
        )
        outcome: AgentOutcome | None = None
        try:
            with anyio.move_on_after(mt.episode_timeout_s) as scope:
                outcome = await agent.run(run)
        finally:
            await end_session("the episode ended")
        return gw.capture(sid), outcome, scope.cancelled_caught

    async def _grade(self, ctx: EpisodeContext) -> float:
        """The reward: from the submitting command's step, else grade the workspace as it is."""
        from psrl.environments.swe.actions import Submit

        if self._final is None:
            _, reward, _, info = await ctx.env.step(Submit())
            _add_metrics(self._metrics, info)
            self._final = (float(reward), info)
        return self._final[0]

    def _status(self, ctx, capture, outcome, timed_out, metrics) -> tuple[Status, str | None]:  # noqa: ANN001
        mt = ctx.multi_turn
        exit_status = outcome.exit_status if outcome is not None else "TimeLimit"
        metrics[f"exit_{exit_status}"] = 1.0
        if timed_out:
            metrics["time_limit"] = 1.0
            return Status.TRUNCATED, f"time limit of {mt.episode_timeout_s:g} s reached"
        if (capture.closed_reason or "").startswith("turn limit") or exit_status == "LimitsExceeded":
            metrics["turn_limit"] = 1.0
            return Status.TRUNCATED, f"turn limit of {mt.max_turns} model calls reached"
        if exit_status in _EXIT_OK or exit_status in _EXIT_FORMAT:
            return Status.OK, None
        if exit_status == "SessionClosed":
            return Status.TRUNCATED, f"the session closed: {capture.closed_reason}"
        return Status.FAILED, f"agent ended with {exit_status}: {outcome.error}"

    def _trajectory(self, ctx, task, capture, reward, status, error, metrics) -> Trajectory:  # noqa: ANN001
        if capture is None or not capture.calls:
            self.trajectories = []
            return Trajectory.from_steps(
                ctx.key, ctx.group_id, [], [], reward=reward, status=status if capture is not None else Status.FAILED,
                error=error, env_metrics=metrics, data_source=task.data_source,
            )
        self.trajectories = capture.trajectories(
            ctx.key, ctx.group_id, reward=reward, status=status, error=error, env_metrics=metrics, data_source=task.data_source
        )
        for t in self.trajectories:
            t.env_metrics["samples"] = float(len(self.trajectories))
        main = max(self.trajectories, key=lambda t: int(t.loss_mask.sum()))
        first = self.trajectories[0]
        first.key, main.key = main.key, ctx.key  # the returned one carries the episode key
        return main
