"""Shared bits for gateway tests: the tiny model's chat tokenizer and scripted replies."""

from __future__ import annotations

import json
from functools import cache

import numpy as np

from psrl.gateway import ChatTokenizer

BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "run a command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}


@cache
def chat_tokenizer() -> ChatTokenizer:
    from psrl.models import model_dir

    return ChatTokenizer.from_pretrained(str(model_dir("tiny-qwen2")))


def reply_ids(text: str, *, eos: bool = True) -> list[int]:
    """What a model that says ``text`` (then ends its turn) generates."""
    tok = chat_tokenizer()
    ids = tok.encode(text).tolist()
    return ids + sorted(tok.eos_ids)[:1] if eos else ids


def tool_call_ids(command: str, content: str = "Running it.") -> list[int]:
    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    return reply_ids(f"{content}\n<tool_call>{call}</tool_call>")


def assert_capture_matches(capture, requests, results=None) -> None:  # noqa: ANN001
    """Every captured call holds exactly the ids the engine was given (and produced)."""
    assert len(capture.calls) == len(requests)
    for call, req in zip(capture.calls, requests):
        np.testing.assert_array_equal(call.prompt_ids, req.prompt_ids)
        assert call.request_id == req.request_id
    for call, res in zip(capture.calls, results or []):
        np.testing.assert_array_equal(call.output_ids, res.output_ids)
        np.testing.assert_array_equal(call.logprobs, res.logprobs)
        np.testing.assert_array_equal(call.versions, res.versions)
