"""Black-box agents for SWE episodes: the built-in bash agent and the real mini-swe-agent."""

from .base import (
    AGENT_NAMES,
    AgentOutcome,
    AgentRun,
    BlackBoxAgent,
    CommandOutcome,
    make_agent,
    mini_swe_agent_installed,
)

__all__ = ["AGENT_NAMES", "AgentOutcome", "AgentRun", "BlackBoxAgent", "CommandOutcome", "make_agent", "mini_swe_agent_installed"]
