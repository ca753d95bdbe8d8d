"""Tool-call parsers: the model's text -> :class:`~psrl.environments.tools.ToolAction`.

Registered by name in ``TOOL_PARSERS`` (``hermes``; ``qwen`` is the same format). A parser never
raises on model output: what it cannot read becomes a ``ToolCallError`` that the environment
answers with an error message.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol, runtime_checkable

from psrl.environments.tools import ToolAction, ToolCall, ToolCallError


@runtime_checkable
class ToolParser(Protocol):
    def parse(self, text: str) -> ToolAction: ...


def _call_from_json(raw: str, index: int) -> ToolCall | ToolCallError:
    try:
        obj: Any = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCallError(raw, f"not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(obj, dict):
        return ToolCallError(raw, f"expected a JSON object with 'name' and 'arguments', got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError(raw, "the object has no 'name' string")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models send the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCallError(raw, f"'arguments' of {name!r} is a string that is not a JSON object")
    if not isinstance(args, dict):
        return ToolCallError(raw, f"'arguments' of {name!r} must be an object, got {type(args).__name__}")
    return ToolCall(name=name, arguments=args, id=f"call_{index}")


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2/2.5/3).

    An opening tag left unclosed at the very end of the turn is read too: generation that stops
    on the ``</tool_call>`` stop string may not return it.
    """

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def __init__(self) -> None:
        self._block = re.compile(re.escape(self.open_tag) + r"(.*?)(" + re.escape(self.close_tag) + r"|$)", re.DOTALL)

    def parse(self, text: str) -> ToolAction:
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        content_parts: list[str] = []
        pos = 0
        for m in self._block.finditer(text):
            content_parts.append(text[pos : m.start()])
            pos = m.end()
            body = m.group(1).strip()
            index = len(calls) + len(errors)
            result = _call_from_json(body, index) if body else ToolCallError(m.group(0), "empty tool call")
            (calls if isinstance(result, ToolCall) else errors).append(result)  # type: ignore[arg-type]
        content_parts.append(text[pos:])
        return ToolAction(text=text, content="".join(content_parts).strip(), calls=calls, errors=errors)
