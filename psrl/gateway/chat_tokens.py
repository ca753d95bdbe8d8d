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


class ChatTokenizer:
    """A Hugging Face tokenizer with a chat template: text <-> ids, messages -> text."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat template")
        self.hf = tokenizer
        eos = tokenizer.eos_token_id
        self.eos_ids: frozenset[int] = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.eos_text: str = tokenizer.eos_token or ""
        self._rust = _direct_backend(tokenizer, self.eos_text)

    @classmethod
    def from_pretrained(cls, path: str) -> ChatTokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    def render(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None, *, generation: bool) -> str:
        return self.hf.apply_chat_template(
            list(messages), tools=tools, tokenize=False, add_generation_prompt=generation
        )

    def encode(self, text: str) -> np.ndarray:
        if self._rust is None:
            return np.asarray(self.hf.encode(text, add_special_tokens=False), np.int32)
        if len(text) < _HOLD_GIL_BELOW:
            return np.asarray(self._rust.encode(text, add_special_tokens=False).ids, np.int32)
        # Long text (the gateway tokenizes it in a worker thread): the batch call releases the GIL.
        return np.asarray(self._rust.encode_batch([text], add_special_tokens=False)[0].ids, np.int32)

    def decode(self, ids: np.ndarray, *, skip_special: bool = True) -> str:
        ids = np.asarray(ids).tolist()
        if self._rust is None:
            return self.hf.decode(ids, skip_special_tokens=skip_special)
        if len(ids) < _HOLD_GIL_BELOW // 4:
            return self._rust.decode(ids, skip_special_tokens=skip_special)
        return self._rust.decode_batch([ids], skip_special_tokens=skip_special)[0]


# The Rust tokenizer's single-text ``encode`` and ``decode`` hold the GIL throughout (a 1 MB text:
# about a second with every other thread stopped); its batch calls release it but hand the work
# to rayon's thread pool. Texts from this many characters (ids from a quarter of it) take the
# batch calls: the gateway runs those in worker threads, which must not stop its event loop.
_HOLD_GIL_BELOW = 2048


def _direct_backend(tokenizer: Any, eos_text: str) -> Any | None:
    """The Rust tokenizer behind a fast HF tokenizer, when calling it directly gives what the HF
    wrapper gives; else None. Every gateway call encodes and decodes: the wrapper's ``encode``
    goes through ``encode_batch``, which hands even one text to rayon's thread pool (a thread
    wake-up per call, which a busy machine turns into milliseconds), plus ~25 us of Python;
    ``decode`` ~15 us. Equal when the wrapper adds nothing: no truncation or padding set on the
    backend, special tokens matched whole (not split), no clean-up of spaces after decoding;
    checked once more on a probe text."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch"):
        return None  # a slow (Python) tokenizer
    if (
        getattr(tokenizer, "clean_up_tokenization_spaces", True)
        or getattr(tokenizer, "split_special_tokens", False)
        or getattr(backend, "encode_special_tokens", False)
        or backend.truncation is not None
        or backend.padding is not None
    ):
        return None
    probe = f"Hello, world!\n  {eos_text} x = [1, 2]\t\u00e9\u4e2d {eos_text}"
    ids = tokenizer.encode(probe, add_special_tokens=False)
    same = backend.encode(probe, add_special_tokens=False).ids == list(ids) and all(
        backend.decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)
        for skip in (True, False)
    )
    return backend if same else None


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
