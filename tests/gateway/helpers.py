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


def assert_capture_matches(capture, requests, results=None) -> None:
    """Every captured call holds exactly the ids the engine was given (and produced)."""
    assert len(capture.calls) == len(requests)
    for call, req in zip(capture.calls, requests):
        np.testing.assert_array_equal(call.prompt_ids, req.prompt_ids)
        assert call.request_id == req.request_id
    for call, res in zip(capture.calls, results or []):
        np.testing.assert_array_equal(call.output_ids, res.output_ids)
        np.testing.assert_array_equal(call.logprobs, res.logprobs)
        np.testing.assert_array_equal(call.versions, res.versions)


class RecordingEngine:
    """Passes every call through to a real engine and keeps (request, result) pairs, so a test
    can compare the gateway's capture with what the engine really consumed and produced."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.calls: list = []

    async def generate(self, request):
        result = await self.engine.generate(request)
        self.calls.append((request, result))
        return result

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    async def update_weights(self, named_tensors, version: int) -> None:
        await self.engine.update_weights(named_tensors, version)

    def statistics(self):
        return self.engine.statistics()

    async def aclose(self) -> None:
        pass  # the shared engine outlives the test
