"""``verifiers_env``: one task of a verifiers taskset per episode; its rubric gives the reward.

``env_kwargs``: ``taskset`` -- an importable module exporting one ``vf.Taskset`` subclass via
``__all__`` (verifiers' own plugin rule; a ``module:Class`` path works too), ``taskset_args``
(fields of its ``TasksetConfig``), and ``index`` (the task's position in ``load()``) or ``task_id``.

PSRL drives the model (token in, token out, as for every Environment); the verifiers side is
unmodified: its taskset builds the task (prompt, system prompt, data), and after the episode the
conversation -- the exact messages the model saw and wrote -- goes onto a verifiers ``Trace`` and
``Task.score(trace)`` runs the task's reward and metric hooks; the reward is the trace's weighted
reward. Hooks that need a verifiers ``runtime`` (a sandbox box) are skipped, as verifiers itself
does when scoring offline.

Multi-turn: after each model turn the task's ``@vf.stop`` trace predicates run; if none stops
the exchange, ``user`` (``module:function``, ``f(task, trace) -> str | None``) gives the next
user message, None ending the episode. Without ``user`` an episode is single-turn.

Runs on asyncio only (verifiers scores with ``asyncio.gather``), as ``psrl rollout``/``train`` do.

Not run here: verifiers' harness programs (it launches them with ``uv`` in a runtime, with MCP
tool servers and an interception proxy to an OpenAI client), which need network access to
install; so tasks that rely on verifiers tools are not supported by this adapter.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Mapping
from typing import Any

from psrl.environments.base import Task
from psrl.environments.chat import ChatObservation
from psrl.environments.extras import require
from psrl.environments.registry import register_env
from psrl.registry import import_path


def _vf() -> Any:
    return require("verifiers.v1", "verifiers", adapter="verifiers_env")


def _taskset_class(spec: str) -> Any:
    _vf()
    if ":" in spec:
        return import_path(spec)
    from verifiers.v1.utils.loaders import taskset_class

    try:
        return taskset_class(spec)
    except (ModuleNotFoundError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"verifiers_env: taskset {spec!r}: {e}") from None


@functools.lru_cache(maxsize=32)
def _tasks(spec: str, args_json: str) -> list[Any]:
    """Every task of the taskset, built once per process (``load()`` may read files)."""
    cls = _taskset_class(spec)
    config_cls = _config_type(cls)
    taskset = cls(config_cls(id=spec, **json.loads(args_json)))
    return list(taskset)


def _config_type(cls: Any) -> Any:
    from verifiers.v1.configs.taskset import TasksetConfig
    from verifiers.v1.taskset import Taskset
    from verifiers.v1.utils.generic import concrete_type

    return concrete_type(cls, TasksetConfig, origin=Taskset) or TasksetConfig


def _text(content: Any) -> str:
    return content if isinstance(content, str) else str(content or "")


@register_env("verifiers_env")
class VerifiersEnv:
    """Metrics: the trace's metrics (``vf_<name>``) and each reward (``vf_reward_<name>``)."""

    def __init__(
        self,
        *,
        taskset: str | None = None,
        taskset_args: Mapping[str, Any] | str | None = None,
        index: int | None = None,
        task_id: str | None = None,
        user: str | None = None,
    ) -> None:
        self.spec = taskset
        args = json.loads(taskset_args) if isinstance(taskset_args, str) else dict(taskset_args or {})
        self.args_json = json.dumps(args, sort_keys=True)
        self.index, self.task_id = index, task_id
        self.user = import_path(user) if user else None
        self._task: Any = None
        self._messages: list[dict[str, Any]] = []

    def _find(self) -> Any:
        if not self.spec:
            raise ValueError("verifiers_env needs env_kwargs 'taskset' (a module exporting a vf.Taskset)")
        tasks = _tasks(self.spec, self.args_json)
        if self.task_id is not None:
            found = [t for t in tasks if t.data.id == self.task_id]
            if not found:
                raise ValueError(f"verifiers_env: taskset {self.spec!r} has no task with id {self.task_id!r}")
            return found[0]
        if self.index is None or not 0 <= int(self.index) < len(tasks):
            raise ValueError(f"verifiers_env: index {self.index!r} is not a task of {self.spec!r} (it has {len(tasks)})")
        return tasks[int(self.index)]

    async def reset(self, task: Task) -> tuple[ChatObservation, dict[str, Any]]:
        _vf()
        self._task = self._find()
        data = self._task.data
        messages: list[dict[str, Any]] = []
        if data.system_prompt:
            messages.append({"role": "system", "content": data.system_prompt})
        if isinstance(data.prompt, str):
            messages.append({"role": "user", "content": data.prompt})
        else:
            messages.extend({"role": m.role, "content": _text(getattr(m, "content", ""))} for m in data.prompt or [])
        if not messages or messages[-1]["role"] != "user":
            raise ValueError(f"verifiers_env: task {data.idx} of {self.spec!r} has no user prompt to answer")
        self._messages = list(messages)
        return ChatObservation(messages=messages), {}

    def _trace(self) -> Any:
        vf = _vf()
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask

        kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
        nodes = [
            MessageNode(parent=i - 1 if i else None, message=kinds[m["role"]](content=m["content"]), sampled=m["role"] == "assistant")
            for i, m in enumerate(self._messages)
        ]
        t = self._task
        return Trace(task=TraceTask(type=type(t).__name__, data=t.data, key=t.key, hash=t.hash), agent=AgentInfo(config=vf.AgentConfig()), nodes=nodes)

    async def _stopped(self, trace: Any) -> bool:
        for fn in self._task.hooks("stop"):
            params = inspect.signature(fn).parameters
            if "trace" not in params and len(params) != 1:
                continue  # a Request/Response predicate: those apply inside verifiers' own model calls
            result = fn(trace=trace) if "trace" in params else fn(trace)
            if inspect.isawaitable(result):
                result = await result
            if result:
                return True
        return False

    async def step(self, action: Any) -> tuple[ChatObservation, float, bool, dict[str, Any]]:
        if self._task is None:
            raise RuntimeError("step() before reset()")
        text = getattr(action, "text", action)
        self._messages.append({"role": "assistant", "content": text if isinstance(text, str) else str(text)})
        trace = self._trace()
        if self.user is not None and not await self._stopped(trace):
            reply = self.user(self._task, trace)
            if inspect.isawaitable(reply):
                reply = await reply
            if reply is not None:
                self._messages.append({"role": "user", "content": str(reply)})
                return ChatObservation(messages=[self._messages[-1]]), 0.0, False, {}
        await self._task.score(trace)
        metrics = {f"vf_{k}": float(v) for k, v in trace.metrics.items() if v is not None}
        metrics.update({f"vf_reward_{k}": float(r.score) for k, r in trace.rewards.items() if r is not None})
        return ChatObservation(messages=[]), float(trace.reward), True, {"metrics": metrics}

    async def aclose(self) -> None:
        self._task = None
