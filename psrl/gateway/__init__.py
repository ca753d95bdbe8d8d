"""Session-scoped OpenAI-compatible API with token capture (token-in, token-out).

A black-box agent gets a session URL and token; every call it makes goes to one engine replica
(the session id is the Router's sticky key), and the exact prompt ids, output ids, log-probs
and policy versions are captured and merged into trajectories by token prefix. The package also
holds PSRL's tool-call parsers (``tool_calls``, ``vllm_tool_calls``), which the agent loops use too.
"""

from .capture import CapturedCall, SessionCapture, merge_calls
from .chat_tokens import ChatTokenizer, PromptBuilder
from .server import Gateway, GatewayStatistics, open_gateway
from .sessions import SessionInfo
from .tool_calls import ExtractedCall, HarmonyToolParser, HermesToolParser, ToolParser, openai_calls
from .wire import GatewayError

__all__ = [
    "CapturedCall", "ChatTokenizer", "ExtractedCall", "Gateway", "GatewayError", "GatewayStatistics",
    "HarmonyToolParser", "HermesToolParser", "PromptBuilder", "SessionCapture", "SessionInfo", "ToolParser",
    "merge_calls", "open_gateway", "openai_calls",
]
