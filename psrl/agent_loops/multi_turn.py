"""``multi_turn_agent`` and ``multi_turn_completion_agent``: many model turns on one driver.

They differ only in how the AgentData renders observations: as chat messages through the chat
template (``multi_turn_agent``, e.g. tool calls and tool responses), or as raw text appended to a
running completion (``multi_turn_completion_agent``, no template between turns).
Both need ``rollout.multi_turn.enable=true``; ``max_turns``, ``max_response_length`` and
``episode_timeout_s`` come from the same section.

``run`` hands back the driver's coroutine instead of awaiting it in a coroutine of its own: the
caller awaits it just the same, and thousands of live episodes are spared one frame each, which
every resume would walk through (``psrl bench agent-loop``).
"""

from __future__ import annotations

from collections.abc import Awaitable

import anyio

from psrl.environments import Task
from psrl.trajectory import Status, Trajectory

from .base import EpisodeContext
from .driver import run_episode


async def _refuse(name: str, ctx: EpisodeContext, task: Task) -> Trajectory:
    # A row can pick this loop while the config has multi-turn off: record it, do not guess.
    with anyio.CancelScope(shield=True):
        await ctx.env.aclose()
    return Trajectory.from_steps(
        ctx.key, ctx.group_id, [], [], status=Status.FAILED, data_source=task.data_source,
        error=f"agent loop {name!r} needs rollout.multi_turn.enable=true",
    )


class MultiTurnAgentLoop:
    observation_mode = "chat"
    requires_multi_turn = True

    def run(self, ctx: EpisodeContext, task: Task) -> Awaitable[Trajectory]:
        if not ctx.multi_turn.enable:
            return _refuse("multi_turn_agent", ctx, task)
        return run_episode(ctx, task, max_turns=ctx.multi_turn.max_turns)


class MultiTurnCompletionAgentLoop:
    observation_mode = "completion"
    requires_multi_turn = True

    def run(self, ctx: EpisodeContext, task: Task) -> Awaitable[Trajectory]:
        if not ctx.multi_turn.enable:
            return _refuse("multi_turn_completion_agent", ctx, task)
        return run_episode(ctx, task, max_turns=ctx.multi_turn.max_turns)
