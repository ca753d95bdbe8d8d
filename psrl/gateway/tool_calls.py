"""Turn a model's text into OpenAI tool calls.

The gateway sits below ``psrl.agent_loops`` in the layering, so it carries its own extractor for
the Hermes format the shipped chat templates use (``<tool_call>{"name", "arguments"}</tool_call>``)
and accepts any object with the same ``extract`` method for other formats.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class ExtractedCall:
    id: str
    name: str
    arguments: str  # JSON text


@runtime_checkable
class ToolCallExtractor(Protocol):
    def extract(self, text: str) -> tuple[str, list[ExtractedCall]]:
        """``(content without the calls, calls)``; text that is not a well-formed call stays content."""
        ...


class HermesToolCalls:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks."""

    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def extract(self, text: str) -> tuple[str, list[ExtractedCall]]:
        calls: list[ExtractedCall] = []
        kept: list[str] = []
        pos = 0
        for m in self._BLOCK.finditer(text):
            call = self._parse(m.group(1))
            if call is None:
                continue  # malformed: leave it in the content so the agent sees what the model wrote
            kept.append(text[pos : m.start()])
            pos = m.end()
            calls.append(call)
        kept.append(text[pos:])
        content = "".join(kept).strip() if calls else text
        return content, calls

    @staticmethod
    def _parse(body: str) -> ExtractedCall | None:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                json.loads(args)
            except json.JSONDecodeError:
                return None
            arguments = args
        else:
            arguments = json.dumps(args, ensure_ascii=False)
        return ExtractedCall(id=f"call_{uuid.uuid4().hex[:24]}", name=obj["name"], arguments=arguments)
