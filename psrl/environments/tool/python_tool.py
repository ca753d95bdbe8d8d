"""The ``code_interpreter`` tool: runs the model's Python as ``python3`` inside a sandbox."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from psrl.environments.tools import ToolArgumentError, ToolResult
from psrl.sandboxes import Sandbox

PYTHON_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Run Python 3 code and return what it prints (stdout, then stderr). Each call starts a fresh interpreter; print the values you need.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python source to run."}},
            "required": ["code"],
        },
    },
}


def _clip(text: str, limit: int) -> tuple[str, bool]:
    if len(text) <= limit:
        return text, False
    head = limit // 2
    return f"{text[:head]}\n... [{len(text) - limit} characters cut] ...\n{text[len(text) - (limit - head):]}", True


class PythonTool:
    """Each call is one fresh ``python3`` process in the episode's sandbox, fed the code on stdin
    (so ``input()`` sees end-of-file instead of hanging), under a wall-clock limit; what it prints
    is cut to ``max_output_chars`` for the model."""

    name = "code_interpreter"
    schema = PYTHON_SCHEMA

    def __init__(
        self,
        sandbox: Callable[[], Awaitable[Sandbox]],
        *,
        timeout_s: float = 10.0,
        max_output_chars: int = 2048,
        python: str = "python3",
    ) -> None:
        self._sandbox = sandbox
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.python = python

    async def call(self, arguments: Mapping[str, Any]) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ToolArgumentError(f"'code' must be a string of Python source, got {type(code).__name__}")
        if not code.strip():
            raise ToolArgumentError("'code' is empty")
        marker = f"PSRL_EOF_{uuid.uuid4().hex}"
        sandbox = await self._sandbox()
        result = await sandbox.exec(f"{self.python} - <<'{marker}'\n{code}\n{marker}\n", timeout=self.timeout_s)
        metrics: dict[str, float] = {}
        parts = [result.stdout]
        if result.stderr:
            parts.append(result.stderr)
        text = "\n".join(p.rstrip("\n") for p in parts if p)
        if result.timed_out:
            text += f"\n[timed out after {self.timeout_s:g} s]"
            metrics["tool_timeouts"] = 1.0
        elif result.exit_code not in (0, None):
            metrics["tool_exec_errors"] = 1.0
            if not text:
                text = f"[exited with code {result.exit_code}]"
        elif result.exit_code is None and not result.timed_out:
            text += "\n[killed: output over the limit]"
            metrics["tool_exec_errors"] = 1.0
        text, clipped = _clip(text.strip("\n"), self.max_output_chars)
        if clipped or result.truncated:
            metrics["tool_output_truncated"] = 1.0
        return ToolResult(text or "[no output]", metrics)
