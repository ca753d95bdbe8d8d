"""Registries of environments, agent-data codecs and reward functions."""

from __future__ import annotations

from psrl.registry import Registry

ENVIRONMENTS: Registry = Registry("environment")
AGENT_DATA: Registry = Registry("agent data")
REWARD_FUNCTIONS: Registry = Registry("reward function")

register_env = ENVIRONMENTS.register
register_agent_data = AGENT_DATA.register
register_reward = REWARD_FUNCTIONS.register

# Built-ins, imported on first use (``psrl envs`` lists them without importing anything heavy).
ENVIRONMENTS.add("tool_env", "psrl.environments.tool.env:ToolEnv")
AGENT_DATA.add("tool_agent_data", "psrl.environments.tool.agent_data:ToolAgentData")
ENVIRONMENTS.add("mini_swe_env", "psrl.environments.swe.env:MiniSWEEnv")
AGENT_DATA.add("mini_swe_agent_data", "psrl.environments.swe.agent_data:MiniSWEAgentData")
REWARD_FUNCTIONS.add("math", "psrl.environments.rewards:math_reward")
REWARD_FUNCTIONS.add("math_number", "psrl.environments.rewards:math_number_reward")
REWARD_FUNCTIONS.add("contains_digit", "psrl.environments.rewards:contains_digit_reward")
# Adapters for other libraries' environments (the `envs` extra); each imports its library lazily.
ENVIRONMENTS.add("reasoning_gym_env", "psrl.environments.reasoning_gym_env.env:ReasoningGymEnv")
ENVIRONMENTS.add("textarena_env", "psrl.environments.textarena_env.env:TextArenaEnv")
ENVIRONMENTS.add("openenv_env", "psrl.environments.openenv_env.env:OpenEnvEnv")
ENVIRONMENTS.add("verifiers_env", "psrl.environments.verifiers_env.env:VerifiersEnv")
