"""The seam between a SWE episode and a black-box agent.

An agent gets an OpenAI ``base_url`` + key (its session on the gateway), the issue text, and an
``execute(command)`` that runs a command in the episode's sandbox. It runs its own loop and its
own prompts; PSRL sees only its model calls (captured by the gateway) and its commands.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class CommandOutcome:
    output: str  # stdout then stderr
    returncode: int | None  # None when the command was killed (timeout, output limit)
    timed_out: bool = False
    submitted: bool = False  # the command submitted the work: the agent should stop


@dataclass
class AgentRun:
    base_url: str  # an OpenAI base_url, ending in /v1
    api_key: str
    model: str
    task: str  # the issue text
    execute: Callable[[str], Awaitable[CommandOutcome]]
    max_steps: int
    platform: Mapping[str, str] = field(default_factory=dict)  # uname fields, for prompt templates
    # Ends the session (later model calls get 410, commands stop). An agent with parts that a
    # cancellation cannot stop (a worker thread) calls it when cancelled, before waiting for them.
    end_session: Callable[[str], Awaitable[None]] | None = None


@dataclass(frozen=True)
class AgentOutcome:
    exit_status: str  # "Submitted", "LimitsExceeded", "SessionClosed", "FormatErrors", "Error", ...
    steps: int  # model calls made
    error: str | None = None


@runtime_checkable
class BlackBoxAgent(Protocol):
    async def run(self, run: AgentRun) -> AgentOutcome:
        """Work on the task until done; never raise for what the model or a command does."""
        ...


AGENT_NAMES = ("auto", "bash", "mini-swe-agent")


def mini_swe_agent_installed() -> bool:
    return importlib.util.find_spec("minisweagent") is not None


def make_agent(name: str, *, dry_run: bool = False, **options: Any) -> BlackBoxAgent:
    """``"bash"``: the built-in agent; ``"mini-swe-agent"``: the PyPI package; ``"auto"``: the
    package when it is installed, else the built-in one. ``options`` go to the agent's class."""
    if name == "auto":
        name = "mini-swe-agent" if mini_swe_agent_installed() else "bash"
    if name == "bash":
        from .bash_agent import BashAgent

        return BashAgent(**options)
    if name == "mini-swe-agent":
        if not mini_swe_agent_installed():
            raise ModuleNotFoundError("agent 'mini-swe-agent' needs the mini-swe-agent package: pip install 'psrl[swe]'")
        from .mini_swe_agent import MiniSweAgent

        return MiniSweAgent(**options)
    raise ValueError(f"unknown SWE agent {name!r}; known: {', '.join(AGENT_NAMES)}")
