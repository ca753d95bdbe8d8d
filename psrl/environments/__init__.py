"""Environments and their AgentData codecs, registered by name."""

from .base import AgentData, Environment, StepResult, Task
from .registry import AGENT_DATA, ENVIRONMENTS, REWARD_FUNCTIONS, register_agent_data, register_env, register_reward

__all__ = [
    "AGENT_DATA", "ENVIRONMENTS", "REWARD_FUNCTIONS", "AgentData", "Environment", "StepResult", "Task",
    "register_agent_data", "register_env", "register_reward",
]
