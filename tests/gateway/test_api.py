"""The gateway's HTTP API with real clients (openai SDK, httpx) on a real uvicorn server, on
asyncio and trio, backed by the scripted engine (the vLLM path is in test_vllm.py)."""

from __future__ import annotations

import socket

import anyio
import httpx
import numpy as np
import openai
import pytest

from psrl.engines import SamplingParams
from psrl.engines.router import Router
from psrl.gateway import Gateway, open_gateway
from psrl.testing import ScriptedEngine

from .helpers import (
    BASH_TOOL,
    assert_capture_matches,
    chat_tokenizer,
    reply_ids,
    tool_call_ids,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def _client(session) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=session.base_url, api_key=session.token, max_retries=0)


async def test_chat_with_tool_calls_logprobs_and_token_ids():
    engine = ScriptedEngine([tool_call_ids("ls -la"), reply_ids("Done.")], logprob=-0.25)
    async with open_gateway(engine, chat_tokenizer()) as gw:
        s = gw.open_session("ep-1")
        async with _client(s) as client:
            messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "list files"}]
            r = await client.chat.completions.create(
                model="psrl-policy", messages=messages, tools=[BASH_TOOL], logprobs=True, extra_body={"return_token_ids": True}
            )
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content == "Running it."
            [call] = choice.message.tool_calls
            assert call.function.name == "bash" and call.function.arguments == '{"command": "ls -la"}'
            assert [t.logprob for t in choice.logprobs.content] == [-0.25] * len(tool_call_ids("ls -la"))
            assert r.model_extra["prompt_token_ids"] == engine.requests[0].prompt_ids.tolist()
            assert choice.model_extra["token_ids"] == tool_call_ids("ls -la")
            assert r.usage.completion_tokens == len(tool_call_ids("ls -la"))
            messages += [choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "a.txt"}]
            r2 = await client.chat.completions.create(model="psrl-policy", messages=messages, tools=[BASH_TOOL])
            assert r2.choices[0].message.content == "Done." and r2.choices[0].finish_reason == "stop"
        capture = await gw.close_session("ep-1")
    assert_capture_matches(capture, engine.requests)
    [traj] = capture.trajectories("ep-1")  # the second call continued the first: one sample
    assert traj.num_turns == 2
    np.testing.assert_array_equal(engine.requests[1].prompt_ids[: len(traj.prompt_ids)], traj.prompt_ids)


async def test_streaming_chat_and_completions_assemble_to_the_same_reply():
    engine = ScriptedEngine(lambda req: reply_ids("Hello there!"))
    async with open_gateway(engine, chat_tokenizer()) as gw:
        s = gw.open_session()
        async with _client(s) as client:
            stream = await client.chat.completions.create(
                model="psrl-policy", messages=[{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": True}
            )
            text, finish, usage = "", None, None
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    text += c.delta.content or ""
                    finish = c.finish_reason or finish
            assert (text, finish) == ("Hello there!", "stop")
            assert usage.completion_tokens == len(reply_ids("Hello there!"))
            comp = await client.completions.create(model="psrl-policy", prompt="Once upon", max_tokens=3, logprobs=1)
            assert comp.choices[0].text == chat_tokenizer().decode(np.array(reply_ids("Hello there!")[:3]))
            assert comp.choices[0].finish_reason == "length"  # 3 < the scripted reply's length
            assert len(comp.choices[0].logprobs.token_logprobs) == 3
            ids_prompt = await client.completions.create(model="psrl-policy", prompt=[5, 6, 7], max_tokens=64, stream=True)
            streamed = "".join([c.choices[0].text async for c in ids_prompt if c.choices])
            assert streamed == "Hello there!"
        np.testing.assert_array_equal(engine.requests[-1].prompt_ids, [5, 6, 7])
        assert engine.requests[1].sampling.max_tokens == 3


async def test_auth_and_session_errors_have_their_codes():
    engine = ScriptedEngine([reply_ids("ok")])
    async with open_gateway(engine, chat_tokenizer()) as gw:
        a, b = gw.open_session("a"), gw.open_session("b")
        body = {"messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient(base_url=gw.url) as http:
            url = "/sessions/a/v1/chat/completions"
            r = await http.post(url, json=body)
            assert r.status_code == 401 and "missing bearer token" in r.json()["error"]["message"]
            r = await http.post(url, json=body, headers={"Authorization": "Bearer nope"})
            assert r.status_code == 401 and "invalid session token" in r.json()["error"]["message"]
            r = await http.post(url, json=body, headers={"Authorization": f"Bearer {b.token}"})  # b's token, a's id
            assert r.status_code == 404
            r = await http.get("/v1/models")
            assert r.status_code == 401
            r = await http.get("/v1/models", headers={"Authorization": f"Bearer {a.token}"})
            assert r.json()["data"][0]["id"] == gw.model_name
            r = await http.post("/sessions/a/v1/embeddings", json={}, headers={"Authorization": f"Bearer {a.token}"})
            assert r.status_code == 404
            r = await http.post(url, json=body, headers={"Authorization": f"Bearer {a.token}"})
            assert r.status_code == 200
            await gw.close_session("a")
            r = await http.post(url, json=body, headers={"Authorization": f"Bearer {a.token}"})
            assert r.status_code == 410 and "closed" in r.json()["error"]["message"]
            async with _client(b) as client:  # the other session is unaffected
                assert (await client.chat.completions.create(model="psrl-policy", **body)).choices[0].message.content == "ok"
    assert len(engine.requests) == 2


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"messages": [', "malformed JSON"),
        (b"", "request body is empty"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temprature": 0.5}', "unknown field 'temprature'"),
        (b'{"messages": [{"role": "user", "content": "x", "colour": 1}]}', "unknown field 'messages.0.colour'"),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": 2}', "only n=1 is supported"),
        (b'{"messages": [{"role": "wizard", "content": "x"}]}', "messages.0.role"),
        (b'{"messages": []}', "messages"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 1.0}', "penalties are not supported"),
    ],
)
async def test_bad_requests_are_400_with_the_reason(body: bytes, reason: str):
    engine = ScriptedEngine([reply_ids("ok")])
    async with open_gateway(engine, chat_tokenizer()) as gw:
        s = gw.open_session()
        async with httpx.AsyncClient(base_url=s.base_url, headers={"Authorization": f"Bearer {s.token}"}) as http:
            r = await http.post("/chat/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400
            assert reason in r.json()["error"]["message"]
            ok = await http.post("/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            assert ok.status_code == 200  # a bad request does not hurt the session
    assert len(engine.requests) == 1


async def test_turn_limit_closes_the_session_with_the_reason():
    engine = ScriptedEngine([reply_ids("ok")])
    async with open_gateway(engine, chat_tokenizer()) as gw:
        s = gw.open_session(max_calls=2)
        async with _client(s) as client:
            for _ in range(2):
                await client.chat.completions.create(model="psrl-policy", messages=[{"role": "user", "content": "x"}])
            with pytest.raises(openai.APIStatusError) as err:
                await client.chat.completions.create(model="psrl-policy", messages=[{"role": "user", "content": "x"}])
        assert err.value.status_code == 410 and "turn limit of 2 calls" in str(err.value)
        assert gw.capture(s.session_id).closed_reason.startswith("turn limit")
        assert gw.capture(s.session_id).num_calls == 2


async def test_closing_a_session_aborts_its_call_in_flight_and_captures_nothing():
    engine = ScriptedEngine([reply_ids("slow")], delay_s=30.0)
    async with open_gateway(engine, chat_tokenizer()) as gw:
        s = gw.open_session()
        status: list[int] = []

        async def call() -> None:
            async with httpx.AsyncClient(base_url=s.base_url, headers={"Authorization": f"Bearer {s.token}"}) as http:
                r = await http.post("/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
                status.append(r.status_code)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                while engine.statistics().requests_in_flight == 0:
                    await anyio.sleep(0.01)
                capture = await gw.close_session(s.session_id, "episode over")
        assert status == [410] and capture.num_calls == 0
        assert engine.statistics().requests_in_flight == 0


async def test_sampling_lock_keeps_the_sessions_settings():
    engine = ScriptedEngine([reply_ids("ok")])
    base = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=32, seed=7)
    async with open_gateway(engine, chat_tokenizer()) as gw:
        locked, free = gw.open_session(sampling=base, lock_sampling=True), gw.open_session(sampling=base)
        for s in (locked, free):
            async with _client(s) as client:
                await client.chat.completions.create(
                    model="psrl-policy", messages=[{"role": "user", "content": "x"}], temperature=0.0, max_tokens=500, stop=["END"]
                )
    got_locked, got_free = (r.sampling for r in engine.requests)
    assert (got_locked.temperature, got_locked.top_p, got_locked.seed) == (1.0, 0.9, 7)
    assert got_free.temperature == 0.0
    assert got_locked.max_tokens == 32 and got_locked.stop == ("END",)  # the agent may only lower the limit


async def test_router_keeps_each_session_on_one_replica():
    replicas = [ScriptedEngine([reply_ids("a")]), ScriptedEngine([reply_ids("b")])]
    router = Router(replicas)
    async with open_gateway(router, chat_tokenizer()) as gw:
        sessions = [gw.open_session(f"s{i}") for i in range(4)]

        async def talk(s) -> None:
            async with _client(s) as client:
                messages = [{"role": "user", "content": s.session_id}]
                for _ in range(3):
                    r = await client.chat.completions.create(model="psrl-policy", messages=messages)
                    messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]

        async with anyio.create_task_group() as tg:
            for s in sessions:
                tg.start_soon(talk, s)
        for s in sessions:
            ids = {i for i, e in enumerate(replicas) for r in e.requests if r.session_id == s.session_id}
            assert len(ids) == 1, f"session {s.session_id} went to replicas {ids}"
            [traj] = gw.capture(s.session_id).trajectories()
            assert traj.num_turns == 3
        assert all(e.requests for e in replicas)  # sessions were spread over both
        await gw.close_session("s0")
        assert router.session_replica("s0") is None  # the pin is forgotten on close


async def test_many_concurrent_sessions_capture_exactly_what_the_engine_saw():
    engine = ScriptedEngine(lambda req: reply_ids(f"reply {len(req.prompt_ids)}"), delay_s=0.01)
    async with open_gateway(engine, chat_tokenizer()) as gw:
        sessions = [gw.open_session(f"c{i}") for i in range(16)]

        async def talk(s) -> None:
            async with _client(s) as client:
                messages = [{"role": "user", "content": f"I am {s.session_id}"}]
                for turn in range(3):
                    r = await client.chat.completions.create(model="psrl-policy", messages=messages)
                    messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"turn {turn}"}]

        async with anyio.create_task_group() as tg:
            for s in sessions:
                tg.start_soon(talk, s)
        for s in sessions:
            reqs = [r for r in engine.requests if r.session_id == s.session_id]
            capture = await gw.close_session(s.session_id)
            assert_capture_matches(capture, reqs)
            [traj] = capture.trajectories()
            seq = np.concatenate([traj.prompt_ids, traj.response_ids])
            for (start, end), call in zip(traj.turn_bounds, capture.calls):
                np.testing.assert_array_equal(seq[: len(traj.prompt_ids) + start], call.prompt_ids)
                np.testing.assert_array_equal(traj.response_ids[start:end], call.output_ids)
        assert gw.statistics().calls == 48


async def test_engine_errors_are_400_and_counted():
    engine = ScriptedEngine([reply_ids("ok")], vocab_size=10)  # every real prompt is out of range
    async with open_gateway(engine, chat_tokenizer()) as gw:
        s = gw.open_session()
        async with _client(s) as client:
            with pytest.raises(openai.BadRequestError, match="outside"):
                await client.chat.completions.create(model="psrl-policy", messages=[{"role": "user", "content": "x"}])
        assert gw.capture(s.session_id).failed_calls == 1 and gw.capture(s.session_id).num_calls == 0


async def test_server_binds_loopback_only_and_releases_its_port():
    with pytest.raises(ValueError, match="loopback"):
        Gateway(ScriptedEngine([[1]]), chat_tokenizer(), host="0.0.0.0")
    async with open_gateway(ScriptedEngine([[1]]), chat_tokenizer()) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


async def test_a_template_that_rejects_the_warm_up_chat_still_serves(caplog):
    # The gateway renders one user message before serving (the warm-up). A template that needs
    # a system message first must not stop the gateway: the warm-up is skipped with a warning.
    import copy

    from psrl.gateway import ChatTokenizer

    hf = copy.deepcopy(chat_tokenizer().hf)
    hf.chat_template = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message comes first') }}{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    engine = ScriptedEngine([reply_ids("fine")])
    with caplog.at_level("WARNING", logger="psrl.gateway.sessions"):
        async with open_gateway(engine, ChatTokenizer(hf)) as gw:
            s = gw.open_session()
            async with _client(s) as client:
                ok = await client.chat.completions.create(
                    model="psrl-policy", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
                )
                with pytest.raises(openai.BadRequestError, match="system message comes first"):
                    await client.chat.completions.create(model="psrl-policy", messages=[{"role": "user", "content": "hi"}])
    assert ok.choices[0].message.content == "fine"
    assert gw.capture(s.session_id).num_calls == 1  # the warm-up never reached the engine
    assert any("warm-up skipped" in r.getMessage() and "system message comes first" in r.getMessage() for r in caplog.records)
