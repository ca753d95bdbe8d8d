"""Chat messages -> prompt ids, reusing the exact ids of earlier turns.

A black-box agent resends its whole history on every call. Re-tokenizing that text would not give
back the ids the model produced (BPE has many spellings of one string, and tool-call JSON comes
back re-serialized), so when a request extends an earlier one -- the same messages, then the
assistant message the gateway returned, then new messages -- its prompt is built as
``earlier prompt ids + earlier output ids + ids of the new text only``. A request that does not
extend any earlier one is tokenized in full and starts a new sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from psrl.token_ids import TokenIds


class ChatTokenizer:
    """A Hugging Face tokenizer with a chat template: text <-> ids, messages -> text."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat template")
        self.hf = tokenizer
        eos = tokenizer.eos_token_id
        self.eos_ids: frozenset[int] = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.eos_text: str = tokenizer.eos_token or ""
        self.ids = TokenIds(tokenizer)  # the Rust backend directly where that is equal

    @classmethod
    def from_pretrained(cls, path: str) -> ChatTokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    def render(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None, *, generation: bool) -> str:
        return self.hf.apply_chat_template(
            list(messages), tools=tools, tokenize=False, add_generation_prompt=generation
        )

    def encode(self, text: str) -> np.ndarray:
        return self.ids.encode(text)

    def decode(self, ids: np.ndarray, *, skip_special: bool = True) -> str:
        return self.ids.decode(ids, skip_special_tokens=skip_special)


@dataclass
class _ChatTurn:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prompt_text: str
    prompt_ids: np.ndarray
    output_ids: np.ndarray
    reply: dict[str, Any]  # the assistant message the gateway returned, as the template sees it


@dataclass
class _TextTurn:
    prompt_text: str
    prompt_ids: np.ndarray
    output_ids: np.ndarray
    returned_text: str


@dataclass(frozen=True)
class BuiltPrompt:
    ids: np.ndarray
    text: str
    reused: bool  # True when earlier ids were reused (the call continues a sample)


class PromptBuilder:
    """Per session: remembers the last turn of a few conversation threads."""

    def __init__(self, tokenizer: ChatTokenizer, *, max_threads: int = 4) -> None:
        self.tok = tokenizer
        self.max_threads = max_threads
        self._chat: list[_ChatTurn] = []
        self._text: list[_TextTurn] = []

    # ---- chat ---------------------------------------------------------------------------

    def build_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> BuiltPrompt:
        full = self.tok.render(messages, tools, generation=True)
        for turn in reversed(self._chat):
            ids = self._continue_chat(turn, messages, tools, full)
            if ids is not None:
                return BuiltPrompt(ids, full, True)
        return BuiltPrompt(self.tok.encode(full), full, False)

    def remember_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        prompt: BuiltPrompt,
        output_ids: np.ndarray,
        reply: dict[str, Any],
    ) -> None:
        turn = _ChatTurn(list(messages), tools, prompt.text, prompt.ids, np.asarray(output_ids, np.int32), reply)
        # The thread this call continued is superseded by it. A new list, swapped in whole:
        # build_chat may be reading the old one in a worker thread.
        kept = [t for t in self._chat if not _extends(messages, t.messages)]
        self._chat = [*kept, turn][-self.max_threads :]

    def _continue_chat(
        self, turn: _ChatTurn, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, full: str
    ) -> np.ndarray | None:
        k = len(turn.messages)
        if tools != turn.tools or len(messages) <= k or messages[:k] != turn.messages or messages[k] != turn.reply:
            return None
        closed = self.tok.render(messages[: k + 1], tools, generation=False)
        if not (closed.startswith(turn.prompt_text) and full.startswith(closed)):
            return None
        glue = self._glue(closed[len(turn.prompt_text) :], turn.output_ids)
        if glue is None:
            return None
        tail = self.tok.encode(glue + full[len(closed) :])
        return np.concatenate([turn.prompt_ids, turn.output_ids, tail]).astype(np.int32, copy=False)

    def _glue(self, segment: str, output_ids: np.ndarray) -> str | None:
        """The template text that follows the model's own tokens in the rendered assistant turn
        (e.g. the newline after the end-of-turn token, or the end-of-turn token itself when the
        model was cut off before emitting it)."""
        generated = self.tok.decode(output_ids, skip_special=False)
        if segment.startswith(generated):
            return segment[len(generated) :]
        eos = self.tok.eos_text
        if not eos or eos not in segment:
            return None
        at = segment.rfind(eos)
        ended = len(output_ids) > 0 and int(output_ids[-1]) in self.tok.eos_ids
        return segment[at + len(eos) :] if ended else segment[at:]

    # ---- raw completions ----------------------------------------------------------------

    def build_text(self, prompt: str) -> BuiltPrompt:
        for turn in reversed(self._text):
            seen = turn.prompt_text + turn.returned_text
            if prompt.startswith(seen):
                rest = self.tok.encode(prompt[len(seen) :])
                ids = np.concatenate([turn.prompt_ids, turn.output_ids, rest]).astype(np.int32, copy=False)
                return BuiltPrompt(ids, prompt, True)
        return BuiltPrompt(self.tok.encode(prompt), prompt, False)

    def remember_text(self, prompt: BuiltPrompt, output_ids: np.ndarray, returned_text: str) -> None:
        kept = [t for t in self._text if not prompt.text.startswith(t.prompt_text + t.returned_text)]
        turn = _TextTurn(prompt.text, prompt.ids, np.asarray(output_ids, np.int32), returned_text)
        self._text = [*kept, turn][-self.max_threads :]


def _extends(messages: list[dict[str, Any]], earlier: list[dict[str, Any]]) -> bool:
    return len(messages) > len(earlier) and messages[: len(earlier)] == earlier
