"""A small bash agent built in, for users without mini-swe-agent.

It speaks plain HTTP to its session (httpx, so it runs under asyncio and trio), offers the model
one ``bash`` tool, and also accepts a fenced ```bash block when the model writes one instead of a
tool call. One command per turn; the episode ends on a submission, the step limit, repeated
format errors, or the session closing.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from ..actions import SUBMIT_MARKER, parse_action
from .base import AgentOutcome, AgentRun, CommandOutcome

BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run one bash command in /workspace and see its output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the command"}},
            "required": ["command"],
        },
    },
}

SYSTEM_PROMPT = f"""You fix issues in the Python repository in /workspace using bash.
Call the bash tool with exactly one command per reply (or write it in a ```bash block).
Each command runs in a fresh shell in /workspace. When the fix is done, run: echo {SUBMIT_MARKER}"""


class BashAgent:
    def __init__(
        self,
        *,
        system_prompt: str = SYSTEM_PROMPT,
        use_tools: bool = True,
        max_output_chars: int = 10_000,
        max_format_errors: int = 3,
        request_timeout_s: float = 600.0,
    ) -> None:
        self.system_prompt = system_prompt
        self.use_tools = use_tools
        self.max_output_chars = max_output_chars
        self.max_format_errors = max_format_errors
        self.request_timeout_s = request_timeout_s

    async def run(self, run: AgentRun) -> AgentOutcome:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": f"Please fix this issue:\n\n{run.task}"},
        ]
        headers = {"Authorization": f"Bearer {run.api_key}"}
        format_errors = 0
        # The session URL is plain http on loopback; not loading the CA bundle saves ~70 ms of
        # event-loop time per episode.
        verify = not run.base_url.startswith("http://")
        async with httpx.AsyncClient(base_url=run.base_url, headers=headers, timeout=self.request_timeout_s, verify=verify) as http:
            for step in range(run.max_steps):
                body: dict[str, Any] = {"model": run.model, "messages": messages}
                if self.use_tools:
                    body["tools"] = [BASH_TOOL]
                try:
                    r = await http.post("/chat/completions", json=body)
                except httpx.HTTPError as e:
                    return AgentOutcome("Error", step, f"model call failed: {type(e).__name__}: {e}")
                if r.status_code == 410:
                    return AgentOutcome("SessionClosed", step, _error_text(r))
                if r.status_code != 200:
                    return AgentOutcome("Error", step + 1, f"model call returned {r.status_code}: {_error_text(r)}")
                message = r.json()["choices"][0]["message"]
                messages.append({k: message[k] for k in ("role", "content", "tool_calls") if message.get(k) is not None})
                commands = self._commands(message)
                if not commands:
                    format_errors += 1
                    if format_errors >= self.max_format_errors:
                        return AgentOutcome("FormatErrors", step + 1, f"{format_errors} replies in a row without a command")
                    messages.append({"role": "user", "content": parse_action(message.get("content") or "").message})  # type: ignore[union-attr]
                    continue
                format_errors = 0
                for i, (call_id, command) in enumerate(commands):
                    if i > 0:  # one command per turn; the others are answered, not run
                        messages.append(self._reply(call_id, "not executed: run one command per reply"))
                        continue
                    out = await run.execute(command)
                    messages.append(self._reply(call_id, self._format(out)))
                    if out.submitted:
                        return AgentOutcome("Submitted", step + 1)
        return AgentOutcome("LimitsExceeded", run.max_steps)

    def _commands(self, message: dict[str, Any]) -> list[tuple[str | None, str]]:
        out: list[tuple[str | None, str]] = []
        for call in message.get("tool_calls") or []:
            fn = call.get("function") or {}
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except json.JSONDecodeError:
                args = {}
            if fn.get("name") == "bash" and isinstance(args, dict) and isinstance(args.get("command"), str):
                out.append((call.get("id"), args["command"]))
        if not out:
            action = parse_action(message.get("content") or "")
            if hasattr(action, "command"):
                out.append((None, action.command))  # type: ignore[union-attr]
        return out

    @staticmethod
    def _reply(call_id: str | None, text: str) -> dict[str, Any]:
        if call_id is None:
            return {"role": "user", "content": text}
        return {"role": "tool", "tool_call_id": call_id, "content": text}

    def _format(self, out: CommandOutcome) -> str:
        text = out.output
        if len(text) > self.max_output_chars:
            half = self.max_output_chars // 2
            text = f"{text[:half]}\n[... {len(text) - 2 * half} characters elided ...]\n{text[-half:]}"
        note = "(the command timed out)\n" if out.timed_out else ""
        return f"{note}exit code: {out.returncode}\n{text}"


def _error_text(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:500]
