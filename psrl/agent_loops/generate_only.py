"""``generate_only_agent``: one model turn, graded by one ``env.step`` (single-turn RLVR)."""

from __future__ import annotations

from psrl.environments import Task
from psrl.trajectory import Trajectory

from .base import EpisodeContext
from .driver import run_episode


class GenerateOnlyAgentLoop:
    """The prompt, one generation, one ``env.step`` for the reward. An env that is not done after
    that step gives a TRUNCATED trajectory."""

    observation_mode = "chat"
    requires_multi_turn = False

    async def run(self, ctx: EpisodeContext, task: Task) -> Trajectory:
        return await run_episode(ctx, task, max_turns=1)
