"""``mini_swe_agent_data``: the policy's tokenizer and the agent that drives a SWE episode.

With ``mini_swe_agent`` (the gateway loop) this object holds the tokenizer the gateway
templates with (``tokenizer``) and builds the black-box agent (``agent``: ``"mini-swe-agent"``, the PyPI package;
``"bash"``, the built-in one; ``"auto"``, the package when installed). With ``multi_turn_agent``
it is an ordinary codec: the chat template renders the issue and each command's output, and a
model turn becomes a :class:`BashAction` (one fenced bash block) or a format error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from psrl.environments.base import ComponentContext
from psrl.environments.chat import ChatObservation, ChatTemplateCodec, as_messages
from psrl.environments.registry import register_agent_data
from psrl.token_ids import TokenIds

from .actions import BashAction, FormatError, parse_action
from .agents import BlackBoxAgent, make_agent


@register_agent_data("mini_swe_agent_data")
class MiniSWEAgentData:
    def __init__(
        self,
        tokenizer: Any,
        *,
        agent: str = "auto",
        agent_options: Mapping[str, Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if tokenizer is None:
            raise ValueError("mini_swe_agent_data needs the policy's tokenizer; the rollout runner was given none")
        self.tokenizer = tokenizer
        self.ids = TokenIds(tokenizer)
        self.agent_name = agent
        self.agent_options = dict(agent_options or {})
        make_agent(agent, dry_run=True, **self.agent_options)  # a bad name or option fails at build time
        self._template_kwargs = chat_template_kwargs
        self._codec: ChatTemplateCodec | None = None
        self._last_output = np.zeros(0, np.int32)

    @classmethod
    def from_context(cls, ctx: ComponentContext, **kwargs: Any) -> MiniSWEAgentData:
        return cls(ctx.tokenizer, **kwargs)

    # ---- the gateway path -------------------------------------------------------------------

    def make_agent(self, name: str | None = None) -> BlackBoxAgent:
        """The black-box agent for one episode (``name`` overrides the configured one)."""
        return make_agent(name or self.agent_name, **self.agent_options)

    # ---- the white-box codec ----------------------------------------------------------------

    @property
    def codec(self) -> ChatTemplateCodec:
        if self._codec is None:
            self._codec = ChatTemplateCodec(self.tokenizer, chat_template_kwargs=self._template_kwargs)
        return self._codec

    def obs_to_tokens(self, obs: Any, *, first: bool) -> np.ndarray:
        messages = obs.messages if isinstance(obs, ChatObservation) else as_messages(obs)
        if first:
            return self.codec.prompt_ids(messages)
        return self.codec.new_message_ids(messages, last_output_ids=self._last_output)

    def tokens_to_action(self, output_ids: np.ndarray) -> BashAction | FormatError:
        self._last_output = np.asarray(output_ids, np.int32)
        return parse_action(self.ids.decode(self._last_output, skip_special_tokens=True))
