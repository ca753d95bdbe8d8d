"""Chat messages -> token ids, one turn at a time, without re-tokenizing the history.

The prompt is the chat template applied to the first messages. After each model turn only the
*new* messages are rendered: the template is applied to a fixed dummy conversation with and
without them, and the text that the new messages add is tokenized. To that we prepend whatever
part of the template's end-of-turn (``<|im_end|>\\n`` for Qwen/SmolLM) the model did not produce
itself, worked out on token ids: a model that stopped on ``<|im_end|>`` still needs the ``\\n``.

For templates that render every message independently (Qwen2/2.5, SmolLM2, ...), the prompt plus
the model's turns plus these deltas is token for token what templating the whole conversation
gives. For templates that re-render earlier turns once later ones exist (Qwen3 strips
``<think>`` from earlier assistant turns, some templates move the system prompt), the two differ;
the token stream here is then still exactly what the model was conditioned on when it generated
each turn, which is what training needs, and nothing is ever re-rendered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from psrl.token_ids import TokenIds

Message = Mapping[str, Any]

_DUMMY_USER = {"role": "user", "content": "u"}
_MARK = "\u2063psrl-turn-end\u2063"  # invisible separator: cannot clash with template text
_BASE = [_DUMMY_USER, {"role": "assistant", "content": _MARK}]


@dataclass
class ChatObservation:
    """What a chat environment returns: the messages that are new since the last turn.

    ``tools`` (OpenAI function schemas) are given with the first observation and are passed to
    the chat template.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class TemplateError(ValueError):
    """The chat template cannot be used incrementally (rendering more messages does not extend the text)."""


def as_messages(prompt: Any) -> list[dict[str, Any]]:
    """A row's prompt as chat messages: a string becomes one user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, Sequence) and all(isinstance(m, Mapping) and "role" in m for m in prompt):
        return [dict(m) for m in prompt]
    raise ValueError(f"prompt must be a string or a list of {{'role', 'content'}} messages, got {type(prompt).__name__}: {prompt!r:.200}")


class ChatTemplateCodec:
    """Token ids for chat turns from a Hugging Face tokenizer's chat template.

    ``chat_template_kwargs`` go to every ``apply_chat_template`` call (e.g. ``enable_thinking``).
    """

    def __init__(self, tokenizer: Any, *, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise TemplateError(f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat template")
        self.tokenizer = tokenizer
        self.ids = TokenIds(tokenizer)
        self.template_kwargs = dict(chat_template_kwargs or {})
        self._terminators: dict[str, np.ndarray] = {}
        self._bases: dict[str, str] = {}

    # ---- rendering ---------------------------------------------------------------------------

    def render(self, messages: Sequence[Message], *, tools: Sequence[Mapping] | None = None, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )

    def encode(self, text: str) -> np.ndarray:
        # Templates write their own BOS; the tokenizer must not add another.
        return self.ids.encode(text)

    def decode(self, ids: np.ndarray, *, skip_special_tokens: bool = True) -> str:
        return self.ids.decode(ids, skip_special_tokens=skip_special_tokens)

    def shows_tools(self) -> bool:
        """Whether the template renders the ``tools`` argument at all (SmolLM2's does not)."""
        probe = [{"type": "function", "function": {"name": "psrl_probe_tool", "description": "", "parameters": {"type": "object", "properties": {}}}}]
        return "psrl_probe_tool" in self.render([_DUMMY_USER], tools=probe, add_generation_prompt=True)

    # ---- ids ---------------------------------------------------------------------------------

    def prompt_ids(self, messages: Sequence[Message], *, tools: Sequence[Mapping] | None = None) -> np.ndarray:
        return self.encode(self.render(messages, tools=tools, add_generation_prompt=True))

    def new_message_ids(
        self,
        messages: Sequence[Message],
        *,
        last_output_ids: np.ndarray | None,
        tools: Sequence[Mapping] | None = None,
    ) -> np.ndarray:
        """Ids to append after the model's turn ``last_output_ids`` so that ``messages`` follow it
        and the next assistant turn is open (generation prompt included)."""
        before = self._base_text(tools)
        after = self.render([*_BASE, *messages], tools=tools, add_generation_prompt=True)
        if not after.startswith(before):
            raise TemplateError(
                "the chat template renders earlier messages differently once new ones follow, so new "
                f"messages cannot be templated on their own; rendered prefix {before[-120:]!r} is not "
                f"a prefix of {after[: len(before) + 40][-160:]!r}"
            )
        delta = self.encode(after[len(before) :])
        rest = self._terminator_rest(last_output_ids, tools)
        return np.concatenate([rest, delta]) if len(rest) else delta

    def _base_text(self, tools: Sequence[Mapping] | None) -> str:
        """The dummy conversation new messages are rendered after (one per tool set: it is the
        same for every turn of an episode, so it is rendered once)."""
        key = repr(tools) if tools else ""
        text = self._bases.get(key)
        if text is None:
            text = self._bases[key] = self.render(_BASE, tools=tools, add_generation_prompt=False)
        return text

    def _terminator(self, tools: Sequence[Mapping] | None) -> np.ndarray:
        """The template's end of an assistant turn, as ids (``<|im_end|>`` ``\\n`` for Qwen)."""
        key = repr(tools) if tools else ""
        if key not in self._terminators:
            text = self._base_text(tools)
            at = text.rfind(_MARK)
            if at < 0:
                raise TemplateError("the chat template drops the assistant message content; cannot find where a turn ends")
            self._terminators[key] = self.encode(text[at + len(_MARK) :])
        return self._terminators[key]

    def _terminator_rest(self, last_output_ids: np.ndarray | None, tools: Sequence[Mapping] | None) -> np.ndarray:
        """The part of the turn terminator the model did not generate: the longest prefix of the
        terminator that ends the output is already there."""
        term = self._terminator(tools)
        out = np.asarray(last_output_ids if last_output_ids is not None else (), np.int32)
        for k in range(min(len(term), len(out)), 0, -1):
            if np.array_equal(out[-k:], term[:k]):
                return term[k:]
        return term
