"""Registries of environments, agent-data codecs and reward functions."""

from __future__ import annotations

from psrl.registry import Registry

ENVIRONMENTS: Registry = Registry("environment")
AGENT_DATA: Registry = Registry("agent data")
REWARD_FUNCTIONS: Registry = Registry("reward function")

register_env = ENVIRONMENTS.register
register_agent_data = AGENT_DATA.register
register_reward = REWARD_FUNCTIONS.register
