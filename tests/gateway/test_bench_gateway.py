"""The gateway benchmark: its arms run in ABBA rounds on the same calls; its load generator's
minimal HTTP/1.1 client speaks real HTTP to the real gateway (the captures match the engine's ids
exactly, as with httpx), and a reply it cannot read is an error naming the call, never a hang or
a wrong figure."""

import json

import anyio
import pytest

from benchmarks.gateway import MinimalHttp, arm_order, main


@pytest.mark.parametrize("http_client", ["minimal", "httpx"])
def test_bench_gateway_runs_with_either_client(capsys, http_client):
    args = ["--sessions", "6", "--turns", "3", "--think-ms", "20", "--client", "inline", "--http-client", http_client]
    assert main([*args, "--rounds", "3", "--json"]) == 0  # 0: every capture exact
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["calls"] == 3 * 18 and out["http_client"] == http_client and out["capture_exact"] is True
    # The odd round's direct arm went first, on the previous round's captures: the same prompts.
    assert out["order"] == "GD DG GD" and out["same_prompts"] is True
    assert out["gateway_p99_ms"] >= out["gateway_p50_ms"] > 0
    assert len(out["added_latency_p99_ms_by_round"]) == 3
    assert out["added_latency_p99_ms_best"] <= out["added_latency_p99_ms_median"] <= max(out["added_latency_p99_ms_by_round"])
    assert out["gateway_cpu_ms_per_call"] > 0 and out["client_cpu_ms_per_call"] is None  # inline: one process


def test_bench_gateway_arms_alternate_and_need_three_rounds(capsys):
    assert [a for _, a in arm_order(4)] == ["gateway", "direct", "direct", "gateway"] * 2
    with pytest.raises(SystemExit):
        main(["--rounds", "2"])
    assert "--rounds must be >= 3" in capsys.readouterr().err


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", "without Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"partial\": ", "closed the connection mid-reply"),
    ],
)
async def test_minimal_client_names_a_reply_it_cannot_read(reply, error):
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def handler(stream):
        async with stream:
            await stream.receive()
            await stream.send(reply)

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handler)
        http = MinimalHttp(f"http://127.0.0.1:{port}/s/x/v1", {"Authorization": "Bearer t"})
        with pytest.raises(RuntimeError, match=error) as info:
            await http.post("/chat/completions", {"messages": []})
        assert "/chat/completions" in str(info.value)
        await http.aclose()
        tg.cancel_scope.cancel()


def test_minimal_client_refuses_a_url_it_cannot_speak_to():
    with pytest.raises(ValueError, match="http://host:port"):
        MinimalHttp("https://127.0.0.1/v1", {})
