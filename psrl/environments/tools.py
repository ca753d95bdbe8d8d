"""Tools an environment offers the model, and running one turn's tool calls concurrently.

A tool-call parser (``psrl.agent_loops.tool_parsers``) turns the model's text into a
:class:`ToolAction`; an environment that holds :class:`Tool` objects answers it with
:func:`run_tool_calls`. Calls the parser could not read, unknown tool names and bad arguments
become error messages for the model and are counted in the returned metrics; they never raise.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import anyio


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""


@dataclass(frozen=True)
class ToolCallError:
    """A span of the model's text that looked like a tool call but could not be read."""

    text: str
    message: str


@dataclass
class ToolAction:
    """One model turn as a tool-using environment sees it."""

    text: str  # the decoded turn, special tokens removed
    content: str  # the text outside tool calls
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ToolCallError] = field(default_factory=list)

    @property
    def wants_tools(self) -> bool:
        """True when the model tried to call a tool (even unreadably): the episode goes on."""
        return bool(self.calls or self.errors)


class ToolArgumentError(ValueError):
    """Raised by a tool for arguments it cannot use; becomes an error message for the model."""


@dataclass(frozen=True)
class ToolResult:
    text: str
    metrics: Mapping[str, float] = field(default_factory=dict)


@runtime_checkable
class Tool(Protocol):
    """A function the model can call. ``schema`` is an OpenAI function schema
    (``{"type": "function", "function": {"name", "description", "parameters"}}``)."""

    name: str
    schema: dict[str, Any]

    async def call(self, arguments: Mapping[str, Any]) -> ToolResult: ...


def tool_message(text: str, *, name: str = "", call_id: str = "") -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "tool", "content": text}
    if name:
        msg["name"] = name
    if call_id:
        msg["tool_call_id"] = call_id
    return msg


def describe_tools(tools: Sequence[Mapping[str, Any]]) -> str:
    """A plain-text tool description for chat templates that do not render ``tools``."""
    lines = [
        "You can call these functions. To call one, write",
        '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>',
        "Available functions:",
    ]
    lines += [json.dumps(t, sort_keys=True) for t in tools]
    return "\n".join(lines)


async def run_tool_calls(
    tools: Mapping[str, Tool],
    action: ToolAction,
    *,
    max_calls: int = 8,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Run the turn's calls concurrently; return one tool message per call (in call order, then
    one per unreadable call) and metrics: ``tool_calls``, ``tool_errors`` (malformed, unknown
    tool, bad arguments, over ``max_calls``) plus whatever the tools report.

    An exception other than :class:`ToolArgumentError` from a tool propagates: it is a failure of
    the environment, not of the model.
    """
    calls = action.calls[:max_calls]
    results: list[ToolResult | None] = [None] * len(calls)
    metrics: dict[str, float] = {"tool_calls": float(len(action.calls) + len(action.errors)), "tool_errors": 0.0}

    failure: list[Exception] = []

    async def one(i: int, call: ToolCall, scope: anyio.CancelScope) -> None:
        tool = tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(tools)) or "(none)"
            results[i] = ToolResult(f"Error: unknown tool {call.name!r}; available tools: {known}", {"tool_errors": 1.0, "unknown_tool": 1.0})
            return
        try:
            results[i] = await tool.call(call.arguments)
        except ToolArgumentError as e:
            results[i] = ToolResult(f"Error: bad arguments for {call.name!r}: {e}", {"tool_errors": 1.0, "bad_arguments": 1.0})
        except Exception as e:  # noqa: BLE001 - re-raised below, unwrapped from the task group
            failure.append(e)
            scope.cancel()  # the turn has failed: stop its other calls

    async with anyio.create_task_group() as tg:
        for i, call in enumerate(calls):
            tg.start_soon(one, i, call, tg.cancel_scope)
    if failure:
        raise failure[0]

    messages = []
    for call, result in zip(calls, results, strict=True):
        assert result is not None
        messages.append(tool_message(result.text, name=call.name, call_id=call.id))
        for k, v in result.metrics.items():
            metrics[k] = metrics.get(k, 0.0) + float(v)
    for call in action.calls[max_calls:]:
        messages.append(tool_message(f"Error: at most {max_calls} tool calls per turn; this call to {call.name!r} was not run", name=call.name, call_id=call.id))
        metrics["tool_errors"] += 1.0
    for err in action.errors:
        messages.append(tool_message(f"Error: could not parse tool call: {err.message}"))
        metrics["tool_errors"] += 1.0
        metrics["malformed_calls"] = metrics.get("malformed_calls", 0.0) + 1.0
    return messages, metrics
