"""The gateway reads any family's tool calls through the shared parser layer: good calls become
OpenAI tool calls, a malformed one stays in the content and is counted, none is dropped."""

from __future__ import annotations

import json

import openai
import pytest

from psrl.agent_loops.tool_parsers import make_tool_parser
from psrl.gateway import ChatTokenizer, open_gateway
from psrl.testing import ScriptedEngine

from .helpers import BASH_TOOL

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

KIMI = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"]


def _kimi_tokenizer() -> ChatTokenizer:
    from transformers import AutoTokenizer

    from psrl.models import model_dir

    hf = AutoTokenizer.from_pretrained(str(model_dir("tiny-qwen2")))
    hf.add_special_tokens({"additional_special_tokens": KIMI})  # the family's markers are special tokens
    return ChatTokenizer(hf)


def _call(i: int, args: str) -> str:
    return f"<|tool_call_begin|>functions.bash:{i}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_kimi_k2_calls_through_the_gateway_keep_the_good_beside_a_bad_one():
    tok = _kimi_tokenizer()
    eos = sorted(tok.eos_ids)[:1]
    good = "Let me look.<|tool_calls_section_begin|>" + _call(0, '{"command": "ls"}') + _call(1, '{"command": "pwd"}') + "<|tool_calls_section_end|>"
    mixed = "<|tool_calls_section_begin|>" + _call(0, '{"command": "ls"}') + _call(1, '{"command": ') + "<|tool_calls_section_end|>"
    engine = ScriptedEngine([tok.encode(good).tolist() + eos, tok.encode(mixed).tolist() + eos])
    async with open_gateway(engine, tok, tool_parser=make_tool_parser("kimi_k2", tok.hf)) as gw:
        s = gw.open_session("kimi")
        async with openai.AsyncOpenAI(base_url=s.base_url, api_key=s.token, max_retries=0) as client:
            messages = [{"role": "user", "content": "where am I?"}]
            r = await client.chat.completions.create(model=gw.model_name, messages=messages, tools=[BASH_TOOL])
            msg = r.choices[0].message
            assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Let me look."
            assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
                ("bash", {"command": "ls"}), ("bash", {"command": "pwd"}),
            ]  # fmt: skip
            r = await client.chat.completions.create(model=gw.model_name, messages=messages, tools=[BASH_TOOL])
            msg = r.choices[0].message
            assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [("bash", {"command": "ls"})]
            assert msg.content == _call(1, '{"command": ')  # the unreadable call is shown, not dropped
        capture = await gw.close_session("kimi")
    assert capture.tool_call_errors == 1 and gw.statistics().tool_call_errors == 1
