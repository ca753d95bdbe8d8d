"""Tool-call parsers by name: ``TOOL_PARSERS`` holds PSRL's own (``hermes``, its alias ``qwen``,
``qwen3_json``, ``openai``) and every family vLLM 0.32 ships (``llama3_json``, ``mistral``,
``pythonic``, ``qwen3_coder``, ``deepseek_v3``, ``kimi_k2``, ...), read through vLLM's parsers.

The parsers themselves live in ``psrl.gateway.tool_calls`` -- the one parser layer the gateway
and the agent loops share (the gateway sits below this package). A parser never raises on model
output: what it cannot read becomes a ``ToolCallError`` that the environment answers with an
error message and counts in ``tool_errors``.
"""

from __future__ import annotations

import inspect
from typing import Any

from psrl.gateway.tool_calls import HarmonyToolParser, HermesToolParser, ToolParser
from psrl.gateway.vllm_tool_calls import VLLMToolParser

__all__ = ["VLLM", "HarmonyToolParser", "HermesToolParser", "ToolParser", "make_tool_parser", "vllm_family"]


def vllm_family(family: str):
    """A parser class for one vLLM family, constructed as ``cls(tokenizer=...)`` like the others."""

    class _Family(VLLMToolParser):
        def __init__(self, tokenizer: Any = None) -> None:
            super().__init__(family, tokenizer)

    _Family.__name__ = _Family.__qualname__ = f"VLLMToolParser[{family}]"
    return _Family


def make_tool_parser(name: str, tokenizer: Any = None) -> ToolParser:
    """The parser registered as ``name`` (or a dotted path), given the tokenizer when it takes one."""
    from .registry import TOOL_PARSERS

    cls = TOOL_PARSERS.get(name)
    try:
        takes_tokenizer = "tokenizer" in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        takes_tokenizer = False
    return cls(tokenizer=tokenizer) if takes_tokenizer else cls()


class _Families:
    """``VLLM.<family>``: the registry's lazy path to each vLLM family's parser class."""

    def __getattr__(self, family: str):
        if family.startswith("__"):
            raise AttributeError(family)
        return vllm_family(family)


VLLM = _Families()
