"""The real mini-swe-agent (PyPI ``mini-swe-agent``) as a black-box agent.

Its own ``DefaultAgent`` loop, prompts (``mini.yaml`` for tool calls, ``mini_textbased.yaml`` for
fenced ``mswea_bash_command`` blocks) and litellm model classes run unchanged: the model is
pointed at the session URL (litellm's ``openai/`` provider with ``api_base``), and its environment
is :class:`SandboxEnvironment`, which sends each command to the episode's sandbox. The agent is
synchronous, so it runs in a worker thread; commands hop back to the event loop. Two settings
differ from its defaults, both for training: no retries (a closed session must end the agent at
once, not after minutes of back-off) and no cost tracking (a local policy has no price).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import yaml

from .base import AgentOutcome, AgentRun, CommandOutcome

STOP_GRACE_S = 30.0  # how long a cancelled run waits for the agent's thread to notice


def _import_minisweagent() -> None:
    # Before the first import: no banner, no fetch of litellm's price list from the network.
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm
    import minisweagent  # noqa: F401

    litellm.suppress_debug_info = True


@dataclass
class _EnvConfig:
    cwd: str = "/workspace"


class SandboxEnvironment:
    """mini-swe-agent's ``Environment`` protocol over a PSRL sandbox (via ``AgentRun.execute``)."""

    def __init__(self, execute: Callable[[str], CommandOutcome], platform: Mapping[str, str], stop: threading.Event) -> None:
        self.config = _EnvConfig()
        self._execute = execute
        self._platform = dict(platform)
        self._stop = stop

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        from minisweagent.exceptions import Submitted

        if self._stop.is_set():
            raise RuntimeError("the episode is over; no more commands run")
        out = self._execute(action.get("command", ""))
        result = {
            "output": out.output,
            "returncode": -1 if out.returncode is None else out.returncode,
            "exception_info": "the command timed out" if out.timed_out else "",
        }
        if out.submitted:
            submission = "".join(out.output.lstrip().splitlines(keepends=True)[1:])
            raise Submitted({"role": "exit", "content": submission, "extra": {"exit_status": "Submitted", "submission": submission}})
        return result

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return {"cwd": self.config.cwd, **self._platform, **kwargs}

    def serialize(self) -> dict:
        return {"info": {"config": {"environment": {"cwd": self.config.cwd}, "environment_type": f"{__name__}.SandboxEnvironment"}}}


def _session_model_class(mode: str) -> type:
    """Its litellm model class, with every error final: retries would outlive the session."""
    if mode == "toolcall":
        from minisweagent.models.litellm_model import LitellmModel as base
    else:
        from minisweagent.models.litellm_textbased_model import (
            LitellmTextbasedModel as base,
        )

    return type(f"Session{base.__name__}", (base,), {"abort_exceptions": [Exception]})


class MiniSweAgent:
    """``mode``: ``"toolcall"`` (its ``mini.yaml``, a ``bash`` tool) or ``"textbased"``
    (``mini_textbased.yaml``, fenced blocks). ``config`` replaces the built-in YAML (a path or a
    mapping with ``agent``/``model`` sections); ``agent_kwargs`` and ``model_config`` override
    single keys of those sections (templates, limits); ``model_kwargs`` go to the API call."""

    def __init__(
        self,
        *,
        mode: Literal["toolcall", "textbased"] = "textbased",
        config: str | Mapping[str, Any] | None = None,
        agent_kwargs: Mapping[str, Any] | None = None,
        model_config: Mapping[str, Any] | None = None,
        model_kwargs: Mapping[str, Any] | None = None,
        request_timeout_s: float = 600.0,
    ) -> None:
        if mode not in ("toolcall", "textbased"):
            raise ValueError(f"mini-swe-agent mode must be 'toolcall' or 'textbased', got {mode!r}")
        self.mode = mode
        self.config = config
        self.agent_kwargs = dict(agent_kwargs or {})
        self.model_config = dict(model_config or {})
        self.model_kwargs = dict(model_kwargs or {})
        self.request_timeout_s = request_timeout_s

    def _load_config(self) -> dict[str, Any]:
        if isinstance(self.config, Mapping):
            return dict(self.config)
        if self.config is None:
            from minisweagent.config import builtin_config_dir

            path = builtin_config_dir / ("mini.yaml" if self.mode == "toolcall" else "mini_textbased.yaml")
        else:
            path = self.config
        with open(path) as fh:
            return yaml.safe_load(fh) or {}

    async def run(self, run: AgentRun) -> AgentOutcome:
        stop, finished = threading.Event(), threading.Event()
        token = anyio.lowlevel.current_token()

        def execute(command: str) -> CommandOutcome:
            return anyio.from_thread.run(run.execute, command, token=token)

        def main() -> AgentOutcome:
            try:
                return self._run_sync(run, execute, stop)
            finally:
                finished.set()

        try:
            # Its own thread token: a long agent run must not starve the shared worker threads.
            return await anyio.to_thread.run_sync(main, abandon_on_cancel=True, limiter=anyio.CapacityLimiter(1))
        finally:
            if not finished.is_set():  # cancelled (time limit): make the thread stop, then wait for it
                stop.set()
                with anyio.move_on_after(STOP_GRACE_S, shield=True):
                    if run.end_session is not None:  # its model call in flight now gets 410
                        await run.end_session("the agent was cancelled")
                    await anyio.to_thread.run_sync(finished.wait, abandon_on_cancel=True, limiter=anyio.CapacityLimiter(1))

    def _run_sync(self, run: AgentRun, execute: Callable[[str], CommandOutcome], stop: threading.Event) -> AgentOutcome:
        _import_minisweagent()
        from minisweagent.agents.default import DefaultAgent

        cfg = self._load_config()
        model_cfg = {**(cfg.get("model") or {}), **self.model_config}
        model_cfg.pop("model_name", None)
        model_cfg.pop("model_class", None)
        api_kwargs = {
            **(model_cfg.pop("model_kwargs", None) or {}),
            **self.model_kwargs,
            "api_base": run.base_url,
            "api_key": run.api_key,
            "num_retries": 0,
            "max_retries": 0,
            "timeout": self.request_timeout_s,
        }
        model = _session_model_class(self.mode)(
            model_name=f"openai/{run.model}", model_kwargs=api_kwargs, cost_tracking="ignore_errors", **model_cfg
        )
        env = SandboxEnvironment(execute, run.platform, stop)
        agent_cfg = {**(cfg.get("agent") or {}), "step_limit": run.max_steps, "cost_limit": 0.0, **self.agent_kwargs}
        agent = DefaultAgent(model, env, **agent_cfg)
        try:
            info = agent.run(run.task)
        except Exception as e:  # noqa: BLE001 - the agent's own failure is its outcome, not ours
            return AgentOutcome("Error", agent.n_calls, f"{type(e).__name__}: {e}")
        return AgentOutcome(str(info.get("exit_status") or "Unknown"), agent.n_calls)
