"""vLLM's tool-call parsers (about 50 model families), held to PSRL's parser contract.

vLLM's parsers return "no call" or raise on output they cannot read, and many read all calls of a
turn or none. Here each family's call markers are known (a table below, else the marker
attributes the vLLM parser carries): text with a marker but no readable call becomes a
``ToolCallError``, and where a family marks each call on its own, every call block is parsed
alone, so one bad call does not drop the good ones. vLLM is imported on first use only.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from psrl.environments.tools import ToolAction, ToolCall, ToolCallError

from .tool_calls import call_from_object


@dataclass(frozen=True)
class Markers:
    """How a family marks calls: each call between ``call``'s begin and end (inside an optional
    ``section``), or, for formats without per-call markers, any of ``detect`` (regexes)."""

    call: tuple[str, str] | None = None
    section: tuple[str, str] | None = None
    detect: tuple[str, ...] = ()
    json_objects: bool = False  # calls are JSON objects in a list or sequence: each is read alone too


_DSV3 = Markers(("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"), ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"))
_KIMI = Markers(("<|tool_call_begin|>", "<|tool_call_end|>"), ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"))
_XML_CALL = Markers(("<tool_call>", "</tool_call>"))
_PYTHONIC = Markers(detect=(r"\[\s*[A-Za-z_][\w.]*\(",))
_JSON_CALL = Markers(detect=(re.escape("<|python_tag|>"), r'\{\s*"name"\s*:'), json_objects=True)

# Families whose markers are known here; others fall back to the vLLM parser's own attributes.
FAMILY_MARKERS: dict[str, Markers] = {
    "deepseek_v3": _DSV3, "deepseek_v31": _DSV3,
    "kimi_k2": _KIMI,
    "qwen3_coder": _XML_CALL, "qwen3_xml": _XML_CALL, "glm45": _XML_CALL, "glm47": _XML_CALL,
    "minimax_m2": Markers(("<invoke", "</invoke>"), ("<minimax:tool_call>", "</minimax:tool_call>")),
    "llama3_json": _JSON_CALL, "llama4_json": _JSON_CALL, "phi4_mini_json": Markers(detect=(r"functools\[",)),
    "mistral": Markers(detect=(re.escape("[TOOL_CALLS]"),), json_objects=True),
    "pythonic": _PYTHONIC, "llama4_pythonic": _PYTHONIC, "olmo3": _PYTHONIC,
    "granite": Markers(detect=(re.escape("<|tool_call|>"),), json_objects=True),
    "xlam": Markers(detect=(r'\[\s*\{\s*"name"', r"<tool_call>", r"```json"), json_objects=True),
}

_MARKER_ATTRS = ("tool_calls_start_token", "tool_call_start_token", "bot_token", "bot_string", "tc_start")


class VLLMToolParser:
    """vLLM's parser for ``family``, built for ``tokenizer`` (the policy's Hugging Face tokenizer:
    many families look their marker tokens up in it)."""

    # Many families' markers are special tokens: decode the turn for this parser without
    # skipping them (the end-of-turn token removed).
    keeps_special_tokens = True

    def __init__(self, family: str, tokenizer: Any) -> None:
        if tokenizer is None:
            raise ValueError(f"tool parser {family!r} (vLLM's) needs the policy's tokenizer")
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        try:
            cls = ToolParserManager.get_tool_parser(family)
        except KeyError as e:
            raise ValueError(f"vLLM has no tool parser {family!r}: {e}") from None
        try:
            self._parser = cls(tokenizer)
        except Exception as e:  # noqa: BLE001 - a family may refuse a tokenizer for many reasons
            raise ValueError(f"vLLM's {family!r} tool parser does not accept this tokenizer: {e}") from None
        self.family = family
        # vLLM logs a traceback for every call it cannot read; here each becomes a ToolCallError
        # on the trajectory instead, so those logs would only repeat it (and fill the terminal).
        for name in ("vllm.tool_parsers", "vllm.parser"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        self._request = ChatCompletionRequest(model="psrl", messages=[{"role": "user", "content": ""}])
        self.markers = FAMILY_MARKERS.get(family) or self._own_markers()
        self._detect = [re.compile(d) for d in self.markers.detect]

    def _own_markers(self) -> Markers:
        found = [getattr(self._parser, a) for a in _MARKER_ATTRS if isinstance(getattr(self._parser, a, None), str)]
        return Markers(detect=tuple(re.escape(m) for m in found if m))

    # ---- parsing --------------------------------------------------------------------------

    def parse(self, text: str) -> ToolAction:
        if self.markers.call is not None:
            return self._parse_blocks(text, *self.markers.call)
        if not any(d.search(text) for d in self._detect):
            return ToolAction(text=text, content=text.strip())
        calls, errors, content = self._extract(text, 0)
        if self.markers.json_objects:
            # vLLM reads such a list whole: one bad object drops every call, or is dropped silently.
            found, bad = _json_objects(text)
            if not calls and found:
                calls, content = found, text[: min(d.search(text).start() for d in self._detect if d.search(text))].strip()
            errors = bad or errors  # the object-by-object reading names each bad call once
        if not calls and not errors:
            errors = [ToolCallError(text, f"the text carries {self.family} tool-call markers but no call could be read")]
        return ToolAction(text=text, content=content, calls=calls, errors=errors)

    def _parse_blocks(self, text: str, begin: str, end: str) -> ToolAction:
        sec_begin, sec_end = self.markers.section or ("", "")
        block = re.compile(re.escape(begin) + r"(.*?)(" + re.escape(end) + r"|$)", re.DOTALL)
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        content: list[str] = []
        pos = 0
        for m in block.finditer(text):
            content.append(text[pos : m.start()])
            pos = m.end()
            got, bad, _ = self._extract(sec_begin + begin + m.group(1) + end + sec_end, len(calls) + len(errors))
            if not got and not bad:
                bad = [ToolCallError(m.group(0), f"no {self.family} tool call could be read from this block")]
            calls += got
            errors += [ToolCallError(m.group(0), e.message) for e in bad]
        content.append(text[pos:])
        rest = "".join(content)
        for marker in (sec_begin, sec_end):
            if marker:
                rest = rest.replace(marker, "")
        return ToolAction(text=text, content=rest.strip(), calls=calls, errors=errors)

    def _extract(self, text: str, first_index: int) -> tuple[list[ToolCall], list[ToolCallError], str]:
        try:
            info = self._parser.extract_tool_calls(text, self._request)
        except Exception as e:  # noqa: BLE001 - model output must never crash a batch
            return [], [ToolCallError(text, f"vLLM's {self.family} parser failed: {type(e).__name__}: {e}")], ""
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        for c in info.tool_calls if info.tools_called else []:
            raw = c.function.arguments or "{}"
            try:
                args = json.loads(raw)
            except json.JSONDecodeError as e:
                errors.append(ToolCallError(raw, f"arguments of {c.function.name!r} are not valid JSON ({e.msg})"))
                continue
            result = call_from_object({"name": c.function.name, "arguments": args}, raw, first_index + len(calls) + len(errors))
            (calls if isinstance(result, ToolCall) else errors).append(result)  # type: ignore[arg-type]
        content = (info.content or "").strip() if info.tools_called else text.strip()
        return calls, errors, content


def _json_objects(text: str) -> tuple[list[ToolCall], list[ToolCallError]]:
    """Every top-level JSON object in ``text`` read as a call on its own; an object that does not
    parse ends the scan as one error (the rest of the text)."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    pos = text.find("{")
    while pos != -1:
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            errors.append(ToolCallError(text[pos:], f"not valid JSON ({e.msg})"))
            break
        result = call_from_object(obj, text[pos:end], len(calls) + len(errors))
        (calls if isinstance(result, ToolCall) else errors).append(result)  # type: ignore[arg-type]
        pos = text.find("{", end)
    return calls, errors
