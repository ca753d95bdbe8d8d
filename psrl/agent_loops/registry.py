"""Registries of agent loops and tool-call parsers, and per-row resolution of components."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from psrl.config import AgentConfig
from psrl.environments import AGENT_DATA, ENVIRONMENTS
from psrl.environments.dataset import merge_env_kwargs
from psrl.registry import Registry

AGENT_LOOPS: Registry = Registry("agent loop")
TOOL_PARSERS: Registry = Registry("tool parser")

register_agent_loop = AGENT_LOOPS.register
register_tool_parser = TOOL_PARSERS.register


@dataclass(frozen=True)
class ResolvedComponents:
    agent_name: str
    env_name: str
    data_name: str
    agent_loop_cls: Any
    env_cls: Any
    data_cls: Any
    env_kwargs: Mapping[str, Any]
    data_kwargs: Mapping[str, Any]


def _row_value(row: Mapping[str, Any], column: str) -> str | None:
    value = row.get(column)
    return value if isinstance(value, str) and value else None


def resolve_components(row: Mapping[str, Any], agent: AgentConfig) -> ResolvedComponents:
    """Which loop / env / agent-data to use for one dataset row.

    The row's ``agent_name``, ``env_class`` and ``data_class`` columns override the config's
    defaults. Config kwargs apply only to the config's own env/data; an override starts from none.
    The row's ``env_kwargs`` (a dict) is merged over the env kwargs either way.
    """
    agent_name = _row_value(row, "agent_name") or agent.default_agent_loop
    env_name = _row_value(row, "env_class") or agent.env.name
    data_name = _row_value(row, "data_class") or agent.data.name
    return ResolvedComponents(
        agent_name=agent_name,
        env_name=env_name,
        data_name=data_name,
        agent_loop_cls=AGENT_LOOPS.get(agent_name),
        env_cls=ENVIRONMENTS.get(env_name),
        data_cls=AGENT_DATA.get(data_name),
        env_kwargs=merge_env_kwargs(agent.env.kwargs if env_name == agent.env.name else {}, row),
        data_kwargs=agent.data.kwargs if data_name == agent.data.name else {},
    )


# Built-ins, imported on first use.
AGENT_LOOPS.add("generate_only_agent", "psrl.agent_loops.generate_only:GenerateOnlyAgentLoop")
AGENT_LOOPS.add("multi_turn_agent", "psrl.agent_loops.multi_turn:MultiTurnAgentLoop")
AGENT_LOOPS.add("multi_turn_completion_agent", "psrl.agent_loops.multi_turn:MultiTurnCompletionAgentLoop")
AGENT_LOOPS.add("mini_swe_agent", "psrl.agent_loops.mini_swe:MiniSWEAgentLoopV1")
TOOL_PARSERS.add("hermes", "psrl.agent_loops.tool_parsers:HermesToolParser")
TOOL_PARSERS.add("qwen", "psrl.agent_loops.tool_parsers:HermesToolParser")
TOOL_PARSERS.add("qwen3_json", "psrl.agent_loops.tool_parsers:HermesToolParser")  # vLLM's name for the same format
TOOL_PARSERS.add("openai", "psrl.agent_loops.tool_parsers:HarmonyToolParser")  # vLLM's is a stub


# The names vLLM 0.32 registers (``vllm.tool_parsers``); PSRL parses hermes/qwen3_json and
# openai itself (see psrl.gateway.tool_calls);
# each other name is read by vLLM's parser under PSRL's contract (psrl.gateway.vllm_tool_calls).
VLLM_FAMILIES: tuple[str, ...] = (
    "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4",
    "deepseek_v41", "dots", "ernie45", "functiongemma", "gemma4", "gigachat3", "glm45", "glm47", "granite",
    "granite-20b-fc", "granite4", "hf", "hunyuan_a13b", "hy_v3", "hy_v4", "inkling", "internlm", "jamba",
    "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3_json", "llama4_json", "llama4_pythonic", "longcat",
    "mimo", "minicpm5", "minimax_m2", "minimax_m3", "mistral", "muse_glimmer", "olmo3", "phi4_mini_json", "plamo3",
    "poolside_v1", "pythonic", "qwen3_coder", "qwen3_xml", "seed_oss", "step3", "step3p5", "xlam",
)  # fmt: skip

for _family in VLLM_FAMILIES:
    TOOL_PARSERS.add(_family, f"psrl.agent_loops.tool_parsers:VLLM.{_family}")
