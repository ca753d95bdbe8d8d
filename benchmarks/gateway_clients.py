"""The load generator of ``psrl bench gateway`` (``benchmarks/gateway.py``): agent sessions over HTTP.

Each session chats ``turns`` turns with the gateway over a client of its own, made when its agent
starts, as each agent has its own: ``MinimalHttp`` (one keep-alive connection, JSON with
Content-Length, what load generators such as wrk do) or httpx (what the OpenAI SDK uses). The
sessions run on the caller's event loop (``run_clients``) or in a process of their own
(``clients_elsewhere``), which then reports its CPU seconds too.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import ssl
import time
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

SYSTEM = "You are a careful software engineer. Answer in one short paragraph."


class MinimalHttp:
    """The load generator's HTTP/1.1 client: one keep-alive connection, a JSON request, a reply
    with Content-Length (what the gateway sends for a call that does not stream). Anything else
    (a chunked reply, a closed connection) is an error naming the call."""

    def __init__(self, base_url: str, headers: dict[str, str]) -> None:
        url = urllib.parse.urlsplit(base_url)
        if url.scheme != "http" or url.hostname is None or url.port is None:
            raise ValueError(f"MinimalHttp needs http://host:port/..., got {base_url!r}")
        self.host, self.port, self.prefix = url.hostname, url.port, url.path.rstrip("/")
        self.headers = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.stream: anyio.abc.SocketStream | None = None
        self.buffer = b""

    async def post(self, path: str, body: Any) -> tuple[int, Any]:
        """POST ``body`` as JSON; returns the status and the decoded JSON reply."""
        if self.stream is None:
            self.stream = await anyio.connect_tcp(self.host, self.port)
        data = json.dumps(body).encode()
        head = (
            f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{self.headers}"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        )
        await self.stream.send(head.encode() + data)
        while b"\r\n\r\n" not in self.buffer:
            await self._more(path)
        raw, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = raw.decode("latin-1").split("\r\n")
        fields = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
        if "content-length" not in fields:
            raise RuntimeError(f"POST {path}: reply without Content-Length ({status_line}; {fields})")
        size = int(fields["content-length"])
        while len(self.buffer) < size:
            await self._more(path)
        reply, self.buffer = self.buffer[:size], self.buffer[size:]
        return int(status_line.split()[1]), json.loads(reply)

    async def _more(self, path: str) -> None:
        assert self.stream is not None
        try:
            self.buffer += await self.stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError) as e:
            raise RuntimeError(f"POST {path}: the server closed the connection mid-reply") from e

    async def aclose(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()


@asynccontextmanager
async def _http_session(kind: str, base_url: str, token: str, tls: ssl.SSLContext | None) -> AsyncIterator[Any]:
    """A ``post(path, body) -> (status, reply)`` for one session, with ``kind`` underneath."""
    headers = {"Authorization": f"Bearer {token}"}
    if kind == "minimal":
        http = MinimalHttp(base_url, headers)
        try:
            yield http.post
        finally:
            await http.aclose()
        return
    import httpx

    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120, verify=tls) as client:

        async def post(path: str, body: Any) -> tuple[int, Any]:
            r = await client.post(path, json=body)
            return r.status_code, r.json()

        yield post


async def run_clients(
    sessions: list[tuple[str, str]], turns: int, think_ms: float, seed: int, http_client: str = "minimal"
) -> list[list[float]]:
    """Every session's chat over real HTTP; per-call round-trip latencies in ms."""
    out: list[list[float]] = [[] for _ in sessions]
    # httpx: plain http on loopback, no certificates to load; one context for every client, as a
    # fleet of agents in one process shares one (a context of its own costs ~0.7 ms per client).
    tls = ssl.create_default_context() if http_client == "httpx" else None

    async def one(i: int, base_url: str, token: str) -> None:
        rng = random.Random(seed + i)
        await anyio.sleep(rng.uniform(0, think_ms) / 1e3)  # sessions start spread out
        # One client per session, made when its agent starts, as each agent has its own.
        async with _http_session(http_client, base_url, token, tls) as post:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Task {i}: sum 1..{i}."}]
            for turn in range(turns):
                t0 = time.perf_counter()
                status, body = await post("/chat/completions", {"model": "psrl-policy", "messages": messages})
                out[i].append((time.perf_counter() - t0) * 1e3)
                if status != 200:
                    raise RuntimeError(f"session {i} turn {turn}: {status} {body}")
                messages += [body["choices"][0]["message"], {"role": "user", "content": f"Now check step {turn}."}]
                await anyio.sleep(rng.uniform(0.5, 1.5) * think_ms / 1e3)

    async with anyio.create_task_group() as tg:
        for i, (url, token) in enumerate(sessions):
            tg.start_soon(one, i, url, token)
    return out


def _client_process(
    sessions: list[tuple[str, str]], turns: int, think_ms: float, seed: int, http_client: str, conn: Any
) -> None:
    """``run_clients`` in a process of its own; its latencies and CPU seconds go back through ``conn``."""
    try:
        cpu0 = time.process_time()
        out = anyio.run(run_clients, sessions, turns, think_ms, seed, http_client)
        conn.send(("ok", (out, time.process_time() - cpu0)))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


async def clients_elsewhere(sessions: list[tuple[str, str]], args: argparse.Namespace, seed: int) -> tuple[list[list[float]], float]:
    """Latencies and the client process's CPU seconds."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_client_process, args=(sessions, args.turns, args.think_ms, seed, args.http_client, child)
    )
    proc.start()
    child.close()
    try:
        status, payload = await anyio.to_thread.run_sync(parent.recv)
    finally:
        await anyio.to_thread.run_sync(proc.join, 30)
        if proc.is_alive():
            proc.kill()
    if status != "ok":
        raise RuntimeError(f"client process failed: {payload}")
    return payload
