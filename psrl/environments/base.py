"""The environment seam: an ``Environment`` holds task state, an ``AgentData`` turns its
observations into tokens and the model's tokens into its actions.

A new task family is one Environment + one AgentData, registered by name. Agent loops, engines
and the trainer do not change when one is added.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar, runtime_checkable

import numpy as np

ObsT = TypeVar("ObsT")
ActT = TypeVar("ActT")
ObsT_co = TypeVar("ObsT_co", covariant=True)
ActT_contra = TypeVar("ActT_contra", contravariant=True)


@dataclass
class Task:
    """One dataset row, as an episode sees it."""

    prompt: Any  # chat messages (list of {"role", "content"}) or a string
    ground_truth: Any = None
    data_source: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    row: Mapping[str, Any] = field(default_factory=dict)  # the raw row, for envs that need more


@dataclass
class StepResult(Generic[ObsT]):
    observation: ObsT
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)

    def __iter__(self):  # allows ``obs, reward, done, info = await env.step(a)``
        return iter((self.observation, self.reward, self.done, self.info))


@runtime_checkable
class Environment(Protocol[ObsT, ActT]):
    """A stateful world for one episode. One instance per rollout; never shared.

    ``reset(task)`` -> ``(observation, info)``; ``step(action)`` -> ``(observation, reward, done,
    info)``. Rewards come from a verifier outside any sandbox the agent can touch. ``aclose()``
    releases everything (sandboxes, processes) and must succeed even after a failed step.
    ``info["metrics"]`` (a dict of floats), when present, is summed into the trajectory's metrics.
    """

    async def reset(self, task: Task) -> tuple[ObsT, dict[str, Any]]: ...

    async def step(self, action: ActT) -> tuple[ObsT, float, bool, dict[str, Any]]: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class AgentData(Protocol[ObsT, ActT]):
    """The codec between an environment and the model's token stream.

    ``obs_to_tokens(obs, first=True)`` gives the prompt ids of an episode; after each model turn,
    ``obs_to_tokens(obs, first=False)`` gives only the new tokens to append (they get loss mask 0;
    history is never re-tokenized). ``tokens_to_action(ids)`` parses the model's turn; a parse
    failure is an action the environment turns into an error observation, never an exception.

    One instance serves one episode, so it may remember the last model turn (``tokens_to_action``
    is always called before the next ``obs_to_tokens``): a chat codec needs it to know whether the
    model already produced the end-of-turn token the chat template would put there.

    How observations become tokens (a chat message rendered by the template, or raw text appended
    to a running completion) is fixed when the instance is built, through
    :class:`ComponentContext` ``.observation_mode``, rather than by a keyword on every call: the
    mode belongs to the agent loop, is constant for the episode, and codecs that have only one mode
    (such as ``psrl.testing.ByteAgentData``) keep the two-method signature unchanged.
    """

    def obs_to_tokens(self, obs: ObsT, *, first: bool) -> np.ndarray: ...

    def tokens_to_action(self, output_ids: np.ndarray) -> ActT: ...


@dataclass(frozen=True)
class ComponentContext:
    """What the rollout runner offers to the Environment and AgentData it builds for an episode.

    A class that wants any of it defines ``from_context(ctx, **kwargs)``; a class without that
    classmethod is built as ``cls(**kwargs)``, so plain user classes need no PSRL types at all.
    """

    tokenizer: Any = None  # a Hugging Face tokenizer of the policy model
    tool_parser: Any = None  # an object with ``parse(text)`` (see psrl.agent_loops.tool_parsers)
    # "chat": each observation is a chat message rendered by the chat template;
    # "completion": observations are appended as raw text, no template between turns.
    observation_mode: Literal["chat", "completion"] = "chat"
    sandbox_pool: Any = None  # a psrl.sandboxes pool; environments take one sandbox per episode


def build_component(cls: Any, ctx: ComponentContext, kwargs: Mapping[str, Any]) -> Any:
    """``cls.from_context(ctx, **kwargs)`` when the class has it, else ``cls(**kwargs)``."""
    factory = getattr(cls, "from_context", None)
    return factory(ctx, **kwargs) if factory is not None else cls(**kwargs)
