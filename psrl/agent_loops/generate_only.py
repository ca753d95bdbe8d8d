"""``generate_only_agent``: one model turn, graded by one ``env.step`` (single-turn RLVR)."""

from __future__ import annotations

from collections.abc import Awaitable

from psrl.environments import Task
from psrl.trajectory import Trajectory

from .base import EpisodeContext
from .driver import run_episode


class GenerateOnlyAgentLoop:
    """The prompt, one generation, one ``env.step`` for the reward. An env that is not done after
    that step gives a TRUNCATED trajectory."""

    observation_mode = "chat"
    requires_multi_turn = False

    def run(self, ctx: EpisodeContext, task: Task) -> Awaitable[Trajectory]:
        return run_episode(ctx, task, max_turns=1)  # the driver's coroutine: see multi_turn.py
