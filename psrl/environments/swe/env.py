"""``mini_swe_env``: a task repository in a sandbox, bash commands, and grading apart from the agent.

``reset`` puts the task's repository snapshot in ``/workspace`` of a sandbox of its own and
returns the issue (as chat messages, so ``multi_turn_agent`` can drive it too; ``info["issue"]``
holds the bare text for black-box agents). Each ``step`` runs one command there. The episode
ends on a submission (a command that prints ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` first, or
a :class:`Submit` action): the workspace's changes are collected, the agent's sandbox is given
back, and the hidden tests run on snapshot + changes in a fresh sandbox. The reward is the
fraction of hidden tests that pass.
"""

from __future__ import annotations

import platform
from contextlib import AsyncExitStack
from typing import Any

import anyio

from psrl.config import SandboxSpec
from psrl.environments.base import ComponentContext, Task
from psrl.environments.chat import ChatObservation
from psrl.environments.registry import register_env
from psrl.sandboxes import Sandbox, make_backend

from .actions import (
    SUBMIT_MARKER,
    BashAction,
    FormatError,
    Submit,
    is_submission,
    parse_action,
)
from .task import SWETask, resolve_task
from .workspace import DiffError, GradeResult, collect_diff, grade, upload_repo

DEFAULT_SYSTEM_PROMPT = f"""You are a software engineer working in a Linux shell on a Python repository in /workspace.
Each reply must contain exactly one bash command in a ```bash block; it runs in a fresh shell in /workspace.
Fix the issue in the repository's source code. When you are done, reply with:
```bash
echo {SUBMIT_MARKER}
```"""


class _Sandboxes:
    """Sandboxes leased from the runner's ``SandboxPool``, or, with no pool, made by a backend
    (``sandbox_backend``, else one built from ``sandbox_spec``) and closed on release."""

    def __init__(self, pool: Any, backend: Any, spec: SandboxSpec | None) -> None:
        self._pool, self._backend, self._spec = pool, backend, spec
        self._owns_backend = False
        self._leases: dict[int, AsyncExitStack] = {}

    async def acquire(self) -> Sandbox:
        if self._pool is not None:
            stack = AsyncExitStack()
            sandbox = await stack.enter_async_context(self._pool.acquire())
            self._leases[id(sandbox)] = stack
            return sandbox
        if self._backend is None:
            self._backend, self._owns_backend = make_backend(self._spec or SandboxSpec()), True
        return await self._backend.create()

    async def release(self, sandbox: Sandbox) -> None:
        with anyio.CancelScope(shield=True):
            stack = self._leases.pop(id(sandbox), None)
            if stack is not None:
                await stack.aclose()  # the pool resets it for the next episode
            else:
                await sandbox.aclose()

    async def aclose(self) -> None:
        if self._owns_backend and self._backend is not None:
            with anyio.CancelScope(shield=True):
                await self._backend.aclose()


@register_env("mini_swe_env")
class MiniSWEEnv:
    """One SWE episode. ``sandbox_pool`` (a :class:`psrl.sandboxes.SandboxPool`) lends the
    sandboxes; without one, ``sandbox_backend`` (a ``SandboxBackend``) or a backend built from
    ``sandbox_spec`` (default: bubblewrap) makes them. Metrics: ``commands``, ``command_timeouts``, ``format_errors``,
    ``submitted`` (by the agent), ``graded``, ``tests_passed``, ``tests_total``, ``grade_errors``,
    ``swe/suspect_patch`` (1 when the diff or the test run looked like gaming the grader; such a
    workspace scores 0 unless ``suspect_scores_zero=False``; ``info["suspect"]`` says why).
    Threat model: docs/swe_grading.md."""

    def __init__(
        self,
        *,
        sandbox_pool: Any = None,
        sandbox_backend: Any = None,
        sandbox_spec: SandboxSpec | dict[str, Any] | None = None,
        command_timeout_s: float = 30.0,
        max_output_chars: int = 10_000,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        suspect_scores_zero: bool = True,
    ) -> None:
        spec = SandboxSpec.model_validate(sandbox_spec) if isinstance(sandbox_spec, dict) else sandbox_spec
        self._sandboxes = _Sandboxes(sandbox_pool, sandbox_backend, spec)
        self.command_timeout_s = command_timeout_s
        self.max_output_chars = max_output_chars
        self.system_prompt = system_prompt
        self.suspect_scores_zero = suspect_scores_zero
        self.task: SWETask | None = None
        self._sandbox: Sandbox | None = None
        self._lock = anyio.Lock()  # one command at a time; grading waits for the last one
        self.result: GradeResult | None = None
        self.diff_text = ""
        self._closed = False

    @classmethod
    def from_context(cls, ctx: ComponentContext, **kwargs: Any) -> MiniSWEEnv:
        kwargs.setdefault("sandbox_pool", ctx.sandbox_pool)
        return cls(**kwargs)

    async def reset(self, task: Task) -> tuple[ChatObservation, dict[str, Any]]:
        if self._closed:
            raise RuntimeError("mini_swe_env is closed")
        ref = task.extra_info.get("swe_task", task.ground_truth)
        self.task = swe = resolve_task(ref)
        self._sandbox = await self._sandboxes.acquire()
        await upload_repo(self._sandbox, swe.repo)
        messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": swe.issue}]
        info = {"issue": swe.issue, "task_id": swe.id, "workdir": "/workspace", "platform": platform.uname()._asdict()}
        return ChatObservation(messages=messages), info

    async def step(self, action: Any) -> tuple[ChatObservation, float, bool, dict[str, Any]]:
        if self.task is None:
            raise RuntimeError("step() before reset()")
        if self.result is not None:
            raise RuntimeError("the episode is over: the workspace was already graded")
        if isinstance(action, str):
            action = parse_action(action)
        if isinstance(action, FormatError):
            return self._say(action.message), 0.0, False, {"metrics": {"format_errors": 1.0}}
        if isinstance(action, Submit):
            return await self._finish({}, submitted=False)
        if not isinstance(action, BashAction):
            message = f"Format error: expected a bash command, got {type(action).__name__} {action!r:.80}"
            return self._say(message), 0.0, False, {"metrics": {"format_errors": 1.0}}
        async with self._lock:
            if self._sandbox is None:
                raise RuntimeError("mini_swe_env has no sandbox (closed)")
            r = await self._sandbox.exec(action.command, timeout=self.command_timeout_s)
        output = r.stdout + r.stderr
        metrics = {"commands": 1.0, "command_timeouts": float(r.timed_out)}
        info: dict[str, Any] = {"exit_code": r.exit_code, "output": output, "timed_out": r.timed_out, "truncated": r.truncated}
        if is_submission(r.stdout, r.exit_code):
            return await self._finish({**info, "metrics": metrics}, submitted=True)
        info["metrics"] = metrics
        return self._say(self._format(r.exit_code, output, r.timed_out)), 0.0, False, info

    async def grade(self) -> GradeResult:
        """Grade the workspace as it is now (idempotent); ends the episode."""
        if self.result is None:
            await self._finish({}, submitted=False)
        assert self.result is not None
        return self.result

    async def _finish(self, info: dict[str, Any], *, submitted: bool) -> tuple[ChatObservation, float, bool, dict[str, Any]]:
        assert self.task is not None
        async with self._lock:
            if self.result is None:
                self.result = await self._grade(self.task)
        res = self.result
        metrics = {**info.get("metrics", {}), "submitted": float(submitted), "graded": 1.0, "tests_passed": float(res.passed),
                   "tests_total": float(res.total), "grade_errors": float(res.error is not None), "swe/suspect_patch": float(bool(res.suspect))}
        info = {**info, "metrics": metrics, "tests": res.results, "diff": self.diff_text, "grade_error": res.error,
                "suspect": list(res.suspect)}
        return ChatObservation(messages=[]), res.reward, True, info

    async def _grade(self, task: SWETask) -> GradeResult:
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is None:
            return GradeResult(0.0, 0, len(task.tests) or 1, error="no workspace to grade (the sandbox was closed)")
        try:
            diff = await collect_diff(sandbox, task)
        except DiffError as e:
            return GradeResult(0.0, 0, len(task.tests) or 1, error=f"workspace not graded: {e}")
        finally:
            await self._sandboxes.release(sandbox)  # before taking the fresh one: no pool deadlock
        self.diff_text = diff.unified(task.repo)
        fresh = await self._sandboxes.acquire()
        try:
            return await grade(fresh, task, diff, suspect_scores_zero=self.suspect_scores_zero)
        finally:
            await self._sandboxes.release(fresh)

    def _say(self, text: str) -> ChatObservation:
        return ChatObservation(messages=[{"role": "user", "content": text}])

    def _format(self, exit_code: int | None, output: str, timed_out: bool) -> str:
        if len(output) > self.max_output_chars:
            half = self.max_output_chars // 2
            output = f"{output[:half]}\n[... {len(output) - 2 * half} characters elided ...]\n{output[-half:]}"
        note = f"<warning>the command timed out after {self.command_timeout_s:g} s</warning>\n" if timed_out else ""
        return f"{note}<returncode>{exit_code}</returncode>\n<output>\n{output}</output>"

    async def aclose(self) -> None:
        self._closed = True
        sandbox, self._sandbox = self._sandbox, None
        try:
            if sandbox is not None:
                await self._sandboxes.release(sandbox)
        finally:
            await self._sandboxes.aclose()
