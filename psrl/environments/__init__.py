"""Environments and their AgentData codecs, registered by name."""

from .base import AgentData, ComponentContext, Environment, StepResult, Task, build_component
from .registry import AGENT_DATA, ENVIRONMENTS, REWARD_FUNCTIONS, register_agent_data, register_env, register_reward

__all__ = [
    "AGENT_DATA", "ENVIRONMENTS", "REWARD_FUNCTIONS", "AgentData", "ComponentContext", "Environment",
    "StepResult", "Task", "build_component", "register_agent_data", "register_env", "register_reward",
]
