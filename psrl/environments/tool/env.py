"""``tool_env``: ReTool-style math with a Python interpreter.

The model reasons, calls ``code_interpreter`` (its code runs in the episode's own sandbox) as
often as it likes, and ends with a turn that calls no tool; that turn's last ``\\boxed{}`` is
graded against the row's ``reward_model.ground_truth`` here, outside the sandbox.
"""

from __future__ import annotations

import contextlib
from typing import Any

import anyio

from psrl.environments.base import ComponentContext, Task
from psrl.environments.chat import ChatObservation, as_messages
from psrl.environments.registry import REWARD_FUNCTIONS, register_env
from psrl.environments.tools import Tool, ToolAction, run_tool_calls
from psrl.sandboxes import Sandbox

from .python_tool import PythonTool


@register_env("tool_env")
class ToolEnv:
    """One episode's interpreter and grader.

    ``sandbox_pool`` (a ``psrl.sandboxes.SandboxPool``) lends one sandbox per episode: taken on
    the first tool call (an episode that never calls a tool costs no sandbox) and given back,
    reset, by ``aclose()``. ``reward`` names a registered
    reward function ``f(solution_text, ground_truth) -> float``.
    Metrics per step: ``tool_calls``, ``tool_errors`` (malformed call, unknown tool, bad
    arguments), ``tool_exec_errors``, ``tool_timeouts``, ``tool_output_truncated``.
    """

    def __init__(
        self,
        *,
        sandbox_pool: Any = None,
        reward: str = "math",
        timeout_s: float = 10.0,
        max_output_chars: int = 2048,
        max_calls_per_turn: int = 4,
        python: str = "python3",
    ) -> None:
        self._pool = sandbox_pool
        self._reward_fn = REWARD_FUNCTIONS.get(reward)
        self.max_calls_per_turn = max_calls_per_turn
        python_tool = PythonTool(self._sandbox, timeout_s=timeout_s, max_output_chars=max_output_chars, python=python)
        self.tools: dict[str, Tool] = {python_tool.name: python_tool}
        self._sandbox_obj: Sandbox | None = None
        self._lease = contextlib.AsyncExitStack()  # holds the pool's acquire() context
        self._lock = anyio.Lock()
        self._task: Task | None = None
        self._closed = False

    @classmethod
    def from_context(cls, ctx: ComponentContext, **kwargs: Any) -> ToolEnv:
        kwargs.setdefault("sandbox_pool", ctx.sandbox_pool)
        return cls(**kwargs)

    async def _sandbox(self) -> Sandbox:
        async with self._lock:  # concurrent calls of one turn share the first acquisition
            if self._closed:
                raise RuntimeError("tool_env is closed")
            if self._sandbox_obj is None:
                if self._pool is None:
                    raise RuntimeError("tool_env has no sandbox pool: the rollout runner must be given one (config: sandbox)")
                self._sandbox_obj = await self._lease.enter_async_context(self._pool.acquire())
            return self._sandbox_obj

    async def reset(self, task: Task) -> tuple[ChatObservation, dict[str, Any]]:
        self._task = task
        tools = [t.schema for t in self.tools.values()]
        return ChatObservation(messages=as_messages(task.prompt), tools=tools), {}

    async def step(self, action: ToolAction | str) -> tuple[ChatObservation, float, bool, dict[str, Any]]:
        if self._task is None:
            raise RuntimeError("step() before reset()")
        if not isinstance(action, ToolAction):  # plain text: a final answer with no tool calls
            action = ToolAction(text=str(action), content=str(action))
        if action.wants_tools:
            messages, metrics = await run_tool_calls(self.tools, action, max_calls=self.max_calls_per_turn)
            return ChatObservation(messages=messages), 0.0, False, {"metrics": metrics}
        reward = float(self._reward_fn(action.text, self._task.ground_truth))
        return ChatObservation(messages=[]), reward, True, {"metrics": {"answered": 1.0}}

    async def aclose(self) -> None:
        self._closed = True
        self._sandbox_obj = None
        with anyio.CancelScope(shield=True):
            await self._lease.aclose()
