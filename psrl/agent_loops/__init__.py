"""Agent loops (registered by name), tool-call parsers and the rollout runner."""

from .base import AgentLoop, EpisodeContext
from .registry import AGENT_LOOPS, TOOL_PARSERS, ResolvedComponents, register_agent_loop, register_tool_parser, resolve_components

__all__ = [
    "AGENT_LOOPS", "TOOL_PARSERS", "AgentLoop", "EpisodeContext", "ResolvedComponents",
    "register_agent_loop", "register_tool_parser", "resolve_components",
]
