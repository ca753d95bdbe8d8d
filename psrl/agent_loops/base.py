"""The agent-loop seam: one episode of one task, from reset to a Trajectory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from psrl.config import MultiTurnConfig
from psrl.engines import InferenceEngine, SamplingParams
from psrl.environments import AgentData, Environment, Task
from psrl.trajectory import Trajectory


@dataclass
class EpisodeContext:
    """Everything one episode needs; built fresh per episode by the rollout runner."""

    key: str
    group_id: str
    engine: InferenceEngine
    env: Environment
    agent_data: AgentData
    sampling: SamplingParams
    multi_turn: MultiTurnConfig
    max_prompt_length: int | None = None  # a longer first observation fails the episode


@runtime_checkable
class AgentLoop(Protocol):
    """Drives one episode. It never raises for env or engine failures: they become a
    trajectory with status FAILED and the error text. Cancellation propagates.

    A loop class may set ``observation_mode = "chat" | "completion"`` (default "chat"): it tells
    the runner how the AgentData it builds for this loop renders observations (see
    ``psrl.environments.ComponentContext``).
    """

    async def run(self, ctx: EpisodeContext, task: Task) -> Trajectory: ...
