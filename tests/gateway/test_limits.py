"""Input limits of the gateway, each with its exact status and OpenAI-style error body, and the
deadlines that cut off slow or stalled clients (real uvicorn, real sockets)."""

from __future__ import annotations

import socket
import time

import anyio
import httpx
import pytest

from psrl.config import GatewayConfig
from psrl.gateway import open_gateway
from psrl.testing import ScriptedEngine

from .helpers import chat_tokenizer, reply_ids

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _http(session) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=session.base_url, headers={"Authorization": f"Bearer {session.token}"}, timeout=30)


def _err(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


async def test_body_over_the_limit_is_413_declared_or_chunked():
    engine = ScriptedEngine(lambda req: reply_ids("ok"))
    async with open_gateway(engine, chat_tokenizer(), settings=GatewayConfig(max_body_bytes=2048)) as gw:
        s = gw.open_session()
        async with _http(s) as http:
            big = {"messages": [{"role": "user", "content": "x" * 3000}]}
            r = await http.post("/chat/completions", json=big)
            assert r.status_code == 413
            size = len(r.request.content)
            assert r.json() == _err(413, f"request body of {size} bytes or more is over this gateway's limit of 2048 bytes (gateway.max_body_bytes)")

            async def chunks():  # no Content-Length: the gateway stops reading at the limit
                for _ in range(10):
                    yield b"x" * 1000

            r = await http.post("/chat/completions", content=chunks())
            assert r.status_code == 413
            got = int(r.json()["error"]["message"].split()[3])  # what had arrived when reading stopped
            assert 2048 < got <= 10_000
            assert r.json() == _err(413, f"request body of {got} bytes or more is over this gateway's limit of 2048 bytes (gateway.max_body_bytes)")
            assert (await http.post("/chat/completions", json=CHAT)).status_code == 200  # under the limit
    assert len(engine.requests) == 1


@pytest.mark.parametrize("bad", [2**31, 2**63 + 5, -1, 10**30])
async def test_token_ids_outside_the_vocabulary_are_400(bad: int):
    engine = ScriptedEngine(lambda req: reply_ids("ok"))
    vocab = len(chat_tokenizer().hf)
    async with open_gateway(engine, chat_tokenizer()) as gw:
        s = gw.open_session()
        async with _http(s) as http:
            r = await http.post("/completions", json={"prompt": [1, 2, bad], "max_tokens": 4})
            assert r.status_code == 400
            assert r.json() == _err(400, f"prompt[2] = {bad} is not a token id of this model (valid ids: 0 to {vocab - 1})", param="prompt")
            r = await http.post("/completions", json={"prompt": [1, vocab - 1], "max_tokens": 4})
            assert r.status_code == 200
    assert [len(q.prompt_ids) for q in engine.requests] == [2]


async def test_unknown_model_is_404_and_aliases_are_served():
    engine = ScriptedEngine(lambda req: reply_ids("ok"))
    settings = GatewayConfig(model_name="policy", model_aliases=["gpt-4o"])
    async with open_gateway(engine, chat_tokenizer(), settings=settings) as gw:
        s = gw.open_session()
        async with _http(s) as http:
            r = await http.post("/chat/completions", json={**CHAT, "model": "llama-70b"})
            assert r.status_code == 404
            assert r.json() == _err(404, "The model 'llama-70b' does not exist; this gateway serves 'policy', 'gpt-4o'", "not_found_error", "model")
            for name in ("policy", "gpt-4o"):
                r = await http.post("/chat/completions", json={**CHAT, "model": name})
                assert r.status_code == 200 and r.json()["model"] == name
    assert len(engine.requests) == 2


async def test_prompt_longer_than_the_engine_takes_is_400():
    engine = ScriptedEngine(lambda req: reply_ids("ok"))
    async with open_gateway(engine, chat_tokenizer(), max_model_len=16) as gw:
        s = gw.open_session()
        async with _http(s) as http:
            r = await http.post("/completions", json={"prompt": list(range(1, 17)), "max_tokens": 4})
            assert r.status_code == 400
            assert r.json() == _err(400, "This model's maximum context length is 16 tokens, but the prompt has 16 tokens: no room to generate", param="prompt")
            r = await http.post("/chat/completions", json={"messages": [{"role": "user", "content": "word " * 40}]})
            n = len(chat_tokenizer().encode(chat_tokenizer().render([{"role": "user", "content": "word " * 40}], None, generation=True)))
            assert r.status_code == 400
            assert r.json() == _err(400, f"This model's maximum context length is 16 tokens, but the prompt has {n} tokens: no room to generate", param="messages")
            assert (await http.post("/completions", json={"prompt": list(range(1, 16)), "max_tokens": 4})).status_code == 200
    assert len(engine.requests) == 1


async def test_a_stalled_body_is_408_and_a_stalled_head_is_cut_off():
    engine = ScriptedEngine(lambda req: reply_ids("ok"))
    settings = GatewayConfig(body_timeout_s=0.5, header_timeout_s=0.5)
    async with open_gateway(engine, chat_tokenizer(), settings=settings) as gw:
        s = gw.open_session("slow")
        port = int(gw.url.rsplit(":", 1)[1])

        def stalled_body() -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
                c.sendall(
                    b"POST /sessions/slow/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + f"Authorization: Bearer {s.token}\r\nContent-Length: 100\r\n\r\n".encode() + b'{"messages": '
                )  # fmt: skip
                got = b""
                while chunk := c.recv(65536):  # the server closes the connection after a 408
                    got += chunk
                return got

        t0 = time.monotonic()
        head, _, body = (await anyio.to_thread.run_sync(stalled_body)).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and 0.4 < time.monotonic() - t0 < 5
        assert body == b'{"error":{"message":"the request body did not arrive within 0.5 s","type":"timeout_error","param":null,"code":408}}'

        def stalled_head() -> tuple[bytes, float]:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
                c.sendall(b"POST /sessions/slow/v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # never finished
                t = time.monotonic()
                return c.recv(65536), time.monotonic() - t

        data, waited = await anyio.to_thread.run_sync(stalled_head)
        assert data == b"" and waited < 2.0  # closed by the server between one and two periods
        async with _http(s) as http:  # the server still serves
            assert (await http.post("/chat/completions", json=CHAT)).status_code == 200


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the thread pool is backend-neutral; one is enough
async def test_a_heavy_request_does_not_stall_another_session():
    """Templating and tokenizing a multi-MB message runs in a worker thread: meanwhile a small
    call of another session is answered in well under a second."""
    engine = ScriptedEngine(lambda req: reply_ids("ok"))
    settings = GatewayConfig(max_body_bytes=64 * 1024 * 1024)
    async with open_gateway(engine, chat_tokenizer(), settings=settings) as gw:
        heavy, light = gw.open_session("heavy"), gw.open_session("light")
        words = " ".join(f"w{i % 9973}" for i in range(200_000))  # ~1.3 MB of text: seconds of work here
        done: dict[str, float] = {}

        async def send_heavy() -> None:
            async with _http(heavy) as http:
                r = await http.post("/chat/completions", json={"messages": [{"role": "user", "content": words}]}, timeout=120)
                assert r.status_code == 200
            done["heavy"] = time.monotonic()

        async with anyio.create_task_group() as tg:
            tg.start_soon(send_heavy)
            await anyio.sleep(0.5)  # the heavy request is being templated and tokenized now
            async with _http(light) as http:
                t0 = time.monotonic()
                r = await http.post("/chat/completions", json=CHAT)
                light_s = time.monotonic() - t0
                done["light"] = time.monotonic()
            assert r.status_code == 200
    assert light_s < 1.0, f"a small call waited {light_s:.2f} s behind a heavy one"
    assert done["light"] < done["heavy"]  # it really overlapped the heavy work
    assert len(engine.requests[0].prompt_ids) < len(engine.requests[1].prompt_ids)
