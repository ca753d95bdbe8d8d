"""``tool_agent_data``: chat messages with tool calls <-> the policy's token ids."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from psrl.environments.base import ComponentContext
from psrl.environments.chat import ChatObservation, ChatTemplateCodec, as_messages
from psrl.environments.registry import register_agent_data
from psrl.environments.tools import ToolAction, describe_tools
from psrl.token_ids import TokenIds


@register_agent_data("tool_agent_data")
class ToolAgentData:
    """Codec for tool-using chat environments (``tool_env`` and any env that returns
    :class:`ChatObservation`).

    - ``mode="chat"``: the prompt and every observation go through the chat template; only the
      new messages are rendered (see :mod:`psrl.environments.chat`).
    - ``mode="completion"``: the prompt goes through the template (a string prompt is used as
      raw text), then each observation is appended as plain text, ``<tool_response>`` blocks
      inside the model's running assistant turn; no template between turns.

    Tool schemas from the first observation go to the template's ``tools``; a template that does
    not show tools (SmolLM2's) gets a plain description appended to the system message instead.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        tool_parser: Any,
        mode: Literal["chat", "completion"] = "chat",
        system_prompt: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if tool_parser is None or not hasattr(tool_parser, "parse"):
            raise ValueError("tool_agent_data needs a tool-call parser with parse(text) (config: rollout.agent.tool_parser)")
        if mode not in ("chat", "completion"):
            raise ValueError(f"tool_agent_data mode must be 'chat' or 'completion', got {mode!r}")
        self.tokenizer = tokenizer
        self.ids = TokenIds(tokenizer)
        self.parser = tool_parser
        self.mode = mode
        self.system_prompt = system_prompt
        self._template_kwargs = chat_template_kwargs
        self._codec: ChatTemplateCodec | None = None
        self._template_tools: list[dict[str, Any]] | None = None
        self._last_output = np.zeros(0, np.int32)

    @classmethod
    def from_context(cls, ctx: ComponentContext, **kwargs: Any) -> ToolAgentData:
        if ctx.tokenizer is None:
            raise ValueError("tool_agent_data needs the policy's tokenizer; the rollout runner was given none")
        kwargs.setdefault("mode", ctx.observation_mode)
        return cls(ctx.tokenizer, tool_parser=ctx.tool_parser, **kwargs)

    @property
    def codec(self) -> ChatTemplateCodec:
        if self._codec is None:
            self._codec = ChatTemplateCodec(self.tokenizer, chat_template_kwargs=self._template_kwargs)
        return self._codec

    # ---- observations -> ids -----------------------------------------------------------------

    def obs_to_tokens(self, obs: Any, *, first: bool) -> np.ndarray:
        if not isinstance(obs, ChatObservation):
            obs = ChatObservation(messages=as_messages(obs))
        if first:
            return self._prompt_ids(obs)
        if self.mode == "chat":
            return self.codec.new_message_ids(obs.messages, last_output_ids=self._last_output, tools=self._template_tools)
        return self._encode_text(self._completion_text(obs.messages))

    def _prompt_ids(self, obs: ChatObservation) -> np.ndarray:
        if self.mode == "completion" and len(obs.messages) == 1 and obs.messages[0]["role"] == "user" and not obs.tools \
                and getattr(self.tokenizer, "chat_template", None) is None:
            return self._encode_text(obs.messages[0]["content"])
        messages = [dict(m) for m in obs.messages]
        if self.system_prompt:
            messages = self._with_system(messages, self.system_prompt)
        tools = list(obs.tools or [])
        if tools and not self.codec.shows_tools():
            messages = self._with_system(messages, describe_tools(tools))
            tools = []
        self._template_tools = tools or None
        return self.codec.prompt_ids(messages, tools=self._template_tools)

    @staticmethod
    def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
        return [{"role": "system", "content": text}, *messages]

    def _completion_text(self, messages: list[dict[str, Any]]) -> str:
        raw = self.ids.decode(self._last_output, skip_special_tokens=False)
        # Generation stopped on the "</tool_call>" stop string without returning it: close the tag.
        parts = ["</tool_call>"] if raw.rfind("<tool_call>") > raw.rfind("</tool_call>") else []
        for msg in messages:
            if msg["role"] == "tool":
                parts.append(f"\n<tool_response>\n{msg['content']}\n</tool_response>")
            else:
                parts.append(f"\n{msg['content']}")
        parts.append("\n")
        return "".join(parts)

    def _encode_text(self, text: str) -> np.ndarray:
        return self.ids.encode(text)

    # ---- ids -> action -----------------------------------------------------------------------

    def tokens_to_action(self, output_ids: np.ndarray) -> ToolAction:
        self._last_output = np.asarray(output_ids, np.int32)
        ids = self._last_output.tolist()
        if getattr(self.parser, "keeps_special_tokens", False):  # its call markers are special tokens
            if ids and ids[-1] == self.tokenizer.eos_token_id:
                ids = ids[:-1]
            return self.parser.parse(self.ids.decode(ids, skip_special_tokens=False))
        return self.parser.parse(self.ids.decode(ids, skip_special_tokens=True))
