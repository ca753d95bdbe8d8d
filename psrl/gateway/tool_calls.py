"""Tool-call parsers: a model's text -> :class:`~psrl.environments.tools.ToolAction`.

The one parser layer of PSRL. Agent loops (``psrl.agent_loops.tool_parsers``, which registers
the names) and the gateway both read calls through a :class:`ToolParser`; it lives here because
the gateway sits below the agent loops. The contract every parser keeps: it never raises on model
output; text that carries the format's call markers but cannot be read becomes a
``ToolCallError`` (an observation for an agent loop, counted in the tool error metrics); one bad
call never drops the good ones.

Formats PSRL parses itself: Hermes (``<tool_call>{json}</tool_call>``, Qwen2/2.5/3) and OpenAI
Harmony (gpt-oss, whose vLLM parser is a stub). Every other vLLM family goes through
:mod:`psrl.gateway.vllm_tool_calls`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from psrl.environments.tools import ToolAction, ToolCall, ToolCallError


@runtime_checkable
class ToolParser(Protocol):
    """``parse`` reads one model turn. A parser whose ``keeps_special_tokens`` is true gets the
    turn decoded with special tokens kept (the end-of-turn token removed)."""

    def parse(self, text: str) -> ToolAction: ...


_NAME = re.compile(r"[\w.:-]{1,128}")


def call_from_object(obj: Any, raw: str, index: int) -> ToolCall | ToolCallError:
    """``{"name": ..., "arguments" | "parameters": {...} | "<json>"}`` -> a call, or why not."""
    if not isinstance(obj, dict):
        return ToolCallError(raw, f"expected a JSON object with 'name' and 'arguments', got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError(raw, "the object has no 'name' string")
    if not _NAME.fullmatch(name):
        return ToolCallError(raw, f"{name[:80]!r} is not a function name (letters, digits, '_', '-', '.', ':')")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models send the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCallError(raw, f"'arguments' of {name!r} is a string that is not a JSON object")
    if not isinstance(args, dict):
        return ToolCallError(raw, f"'arguments' of {name!r} must be an object, got {type(args).__name__}")
    return ToolCall(name=name, arguments=args, id=f"call_{index}")


def call_from_json(raw: str, index: int) -> ToolCall | ToolCallError:
    try:
        obj: Any = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCallError(raw, f"not valid JSON ({e.msg} at character {e.pos})")
    return call_from_object(obj, raw, index)


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2/2.5/3).

    An opening tag left unclosed at the very end of the turn is read too: generation that stops
    on the ``</tool_call>`` stop string may not return it.
    """

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def __init__(self, tokenizer: Any = None) -> None:  # the format needs no tokenizer
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
            result = call_from_json(body, index) if body else ToolCallError(m.group(0), "empty tool call")
            (calls if isinstance(result, ToolCall) else errors).append(result)  # type: ignore[arg-type]
        content_parts.append(text[pos:])
        return ToolAction(text=text, content="".join(content_parts).strip(), calls=calls, errors=errors)


class HarmonyToolParser:
    """OpenAI Harmony (gpt-oss): ``<|start|>assistant<|channel|>commentary to=functions.NAME
    <|constrain|>json<|message|>{...}<|call|>``; the final answer is the ``final`` channel."""

    _CALL = re.compile(r"<\|channel\|>\s*commentary\s+to=([^\s<]+)[^<]*(?:<\|constrain\|>[^<]*)?<\|message\|>(.*?)(<\|call\|>|<\|end\|>|$)", re.DOTALL)
    keeps_special_tokens = True  # <|channel|>, <|message|>, <|call|> are special tokens

    _FINAL = re.compile(r"<\|channel\|>\s*final\s*<\|message\|>(.*?)(?:<\|end\|>|<\|return\|>|$)", re.DOTALL)

    def __init__(self, tokenizer: Any = None) -> None:
        pass

    def parse(self, text: str) -> ToolAction:
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        for m in self._CALL.finditer(text):
            index = len(calls) + len(errors)
            name = m.group(1).removeprefix("functions.")
            try:
                args = json.loads(m.group(2).strip() or "{}")
            except json.JSONDecodeError as e:
                errors.append(ToolCallError(m.group(0), f"arguments of {name!r} are not valid JSON ({e.msg})"))
                continue
            result = call_from_object({"name": name, "arguments": args}, m.group(0), index)
            (calls if isinstance(result, ToolCall) else errors).append(result)  # type: ignore[arg-type]
        final = self._FINAL.search(text)
        if final is not None:
            content = final.group(1).strip()
        else:
            content = text if not (calls or errors) else self._CALL.sub("", text).strip()
        return ToolAction(text=text, content=content, calls=calls, errors=errors)


# ---- the gateway's view: OpenAI tool calls --------------------------------------------------


@dataclass(frozen=True)
class ExtractedCall:
    id: str
    name: str
    arguments: str  # JSON text


def openai_calls(action: ToolAction) -> tuple[str, list[ExtractedCall]]:
    """``(content, calls)`` for an OpenAI reply. Spans that could not be read stay in the content,
    so the agent sees what the model wrote."""
    calls = [
        ExtractedCall(f"call_{uuid.uuid4().hex[:24]}", c.name, json.dumps(c.arguments, ensure_ascii=False)) for c in action.calls
    ]
    if not calls:
        return (action.text if action.errors else action.content), []
    content = "\n".join([action.content, *(e.text for e in action.errors)]).strip()
    return content, calls
