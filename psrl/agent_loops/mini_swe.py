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
from dataclasses import dataclass, field
from typing import Any

import anyio

from psrl.environments import Task
from psrl.gateway import ChatTokenizer, Gateway, SessionCapture, open_gateway
from psrl.trajectory import Status, Trajectory

from .base import EpisodeContext

CLOSE_GRACE_S = 30.0
_EXIT_NORMAL = {"Submitted", "FormatErrors", "RepeatedFormatError", "FormatError"}


def _add_metrics(into: dict[str, float], info: Any) -> None:
    metrics = info.get("metrics") if isinstance(info, dict) else None
    for k, v in (metrics or {}).items():
        into[k] = into.get(k, 0.0) + float(v)


@dataclass
class _Episode:
    """One run's state (a loop instance is shared by every episode the runner starts)."""

    ctx: EpisodeContext
    metrics: dict[str, float] = field(default_factory=dict)
    final: tuple[float, dict[str, Any]] | None = None  # (reward, info) of the grading step
    ended: str | None = None  # why the session was closed
    capture: SessionCapture | None = None
    outcome: Any = None  # the agent's AgentOutcome
    timed_out: bool = False

    async def execute(self, command: str):
        from psrl.environments.swe.actions import BashAction
        from psrl.environments.swe.agents import CommandOutcome

        if self.ended is not None or self.final is not None:
            raise RuntimeError(f"the episode is over ({self.ended or 'submitted'}); no more commands run")
        _, reward, done, info = await self.ctx.env.step(BashAction(command))
        _add_metrics(self.metrics, info)
        if done:
            self.final = (float(reward), info)
        return CommandOutcome(
            output=info.get("output", ""), returncode=info.get("exit_code"),
            timed_out=bool(info.get("timed_out")), submitted=bool(done),
        )

    async def grade(self) -> float:
        """The reward: from the submitting command's step, else grade the workspace as it is."""
        from psrl.environments.swe.actions import Submit

        if self.final is None:
            _, reward, _, info = await self.ctx.env.step(Submit())
            _add_metrics(self.metrics, info)
            self.final = (float(reward), info)
        return self.final[0]

    def status(self) -> tuple[Status, str | None]:
        mt = self.ctx.multi_turn
        exit_status = self.outcome.exit_status if self.outcome is not None else "TimeLimit"
        self.metrics[f"exit_{exit_status}"] = 1.0
        if self.timed_out:
            self.metrics["time_limit"] = 1.0
            return Status.TRUNCATED, f"time limit of {mt.episode_timeout_s:g} s reached"
        closed = (self.capture.closed_reason if self.capture else None) or ""
        if closed.startswith("turn limit") or exit_status == "LimitsExceeded":
            self.metrics["turn_limit"] = 1.0
            return Status.TRUNCATED, f"turn limit of {mt.max_turns} model calls reached"
        if exit_status in _EXIT_NORMAL:
            return Status.OK, None
        if exit_status == "SessionClosed":
            return Status.TRUNCATED, f"the session closed: {closed}"
        return Status.FAILED, f"agent ended with {exit_status}: {self.outcome.error}"


class MiniSWEAgentLoopV1:
    """One SWE episode with a black-box agent. ``gateway`` shares a running gateway between
    episodes (it must serve the episodes' engine); without one each episode serves its own on a
    free loopback port. ``run`` returns the sample with the most generated tokens; ``run_all``
    returns every sample the calls merged into (an agent that rewrites its history makes more
    than one), that one first. Every sample has ``env_metrics["samples"]``."""

    observation_mode = "chat"

    def __init__(self, *, gateway: Gateway | None = None) -> None:
        self.gateway = gateway

    async def run(self, ctx: EpisodeContext, task: Task) -> Trajectory:
        return (await self.run_all(ctx, task))[0]

    async def run_all(self, ctx: EpisodeContext, task: Task) -> list[Trajectory]:
        ep = _Episode(ctx)
        status, error, reward = Status.OK, None, 0.0
        stage = "env.reset"
        try:
            _, info = await ctx.env.reset(task)
            stage = "agent_data.make_agent"
            agent = ctx.agent_data.make_agent(task.extra_info.get("agent"))
            stage = "gateway"
            async with self._gateway(ctx) as gw:
                await self._drive(ep, gw, agent, info)
            ep.metrics["model_calls"] = float(ep.capture.num_calls)
            ep.metrics["failed_model_calls"] = float(ep.capture.failed_calls)
            stage = "grading"
            reward = await ep.grade()
            status, error = ep.status()
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
        return self._trajectories(ep, task, reward, status, error)

    @asynccontextmanager
    async def _gateway(self, ctx: EpisodeContext):
        if self.gateway is not None:
            yield self.gateway
            return
        async with open_gateway(ctx.engine, ChatTokenizer(ctx.agent_data.tokenizer)) as gw:
            yield gw

    async def _drive(self, ep: _Episode, gw: Gateway, agent: Any, info: dict[str, Any]) -> None:
        from psrl.environments.swe.agents import AgentRun

        mt = ep.ctx.multi_turn
        sid = f"{re.sub(r'[^A-Za-z0-9_.-]', '.', ep.ctx.key)}.{secrets.token_hex(3)}"
        session = gw.open_session(sid, sampling=ep.ctx.sampling, lock_sampling=True, max_calls=mt.max_turns)

        async def end_session(reason: str) -> None:
            if ep.ended is None:
                ep.ended = reason
            with anyio.CancelScope(shield=True):
                await gw.close_session(sid, reason)

        run = AgentRun(
            base_url=session.base_url, api_key=session.token, model=gw.model_name, task=info.get("issue", ""),
            execute=ep.execute, max_steps=mt.max_turns, platform=info.get("platform", {}), end_session=end_session,
        )
        try:
            with anyio.move_on_after(mt.episode_timeout_s) as scope:
                ep.outcome = await agent.run(run)
        finally:
            await end_session("the episode ended")
            ep.capture = gw.capture(sid)
        ep.timed_out = scope.cancelled_caught

    def _trajectories(self, ep: _Episode, task: Task, reward: float, status: Status, error: str | None) -> list[Trajectory]:
        ctx, capture = ep.ctx, ep.capture
        if capture is None or not capture.calls:
            ep.metrics["samples"] = 0.0
            return [Trajectory.from_steps(
                ctx.key, ctx.group_id, [], [], reward=reward, status=status, error=error,
                env_metrics=ep.metrics, data_source=task.data_source,
            )]  # fmt: skip
        samples = capture.trajectories(
            ctx.key, ctx.group_id, reward=reward, status=status, error=error, env_metrics=ep.metrics, data_source=task.data_source
        )
        for t in samples:
            t.env_metrics["samples"] = float(len(samples))
        main = max(samples, key=lambda t: int(t.loss_mask.sum()))
        samples[0].key, main.key = main.key, ctx.key  # the returned one carries the episode key
        return [main, *(t for t in samples if t is not main)]
