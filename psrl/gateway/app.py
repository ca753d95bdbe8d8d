"""The HTTP face of the gateway: a Starlette app that writes OpenAI-format JSON and SSE.

The app holds no session state. It reads the request, hands ``(kind, session id, Authorization,
body)`` to ``call`` -- which runs on the loop that owns the sessions -- and formats the reply.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from .limits import read_body
from .sessions import Reply
from .wire import GatewayError

# Runs a coroutine function on the loop that owns the sessions (the same loop under asyncio).
Run = Callable[..., Awaitable[Any]]


class Backend(Protocol):
    """What the app asks of the gateway; every call goes through ``Run``."""

    model_name: str
    max_body_bytes: int
    body_timeout_s: float
    admin_token: str | None

    async def handle(self, kind: str, session_id: str, authorization: str | None, body: bytes) -> Reply: ...

    async def authorize(self, session_id: str | None, authorization: str | None) -> None: ...

    async def admin_open(self, authorization: str | None, body: bytes) -> dict[str, Any]: ...

    async def admin_close(self, authorization: str | None, session_id: str) -> dict[str, Any]: ...

    def decode(self, ids: list[int]) -> str: ...


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def _error(e: GatewayError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    if e.status == 408:  # the rest of the body may still come: this connection carries no other request
        headers = {"Connection": "close"}
    return Response(orjson.dumps(e.body()), status_code=e.status, media_type="application/json", headers=headers)


def _usage(reply: Reply) -> dict[str, int]:
    p, c = len(reply.prompt_ids), len(reply.result.output_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _token_strings(reply: Reply, decode: Callable[[list[int]], str]) -> list[str]:
    return [decode([int(t)]) for t in reply.result.output_ids]


def _tool_calls(reply: Reply, *, streaming: bool) -> list[dict[str, Any]]:
    out = []
    for i, c in enumerate(reply.tool_calls):
        call: dict[str, Any] = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        if streaming:
            call["index"] = i
        out.append(call)
    return out


def chat_body(reply: Reply, decode: Callable[[list[int]], str]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.text if (reply.text or not reply.tool_calls) else None}
    if reply.tool_calls:
        message["tool_calls"] = _tool_calls(reply, streaming=False)
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": reply.finish_reason, "logprobs": None}
    if reply.logprobs:
        choice["logprobs"] = {"content": _chat_logprobs(reply, decode)}
    return _body(reply, "chatcmpl", "chat.completion", choice)


def _chat_logprobs(reply: Reply, decode: Callable[[list[int]], str]) -> list[dict[str, Any]]:
    return [
        {"token": s, "logprob": float(lp), "bytes": list(s.encode()), "top_logprobs": []}
        for s, lp in zip(_token_strings(reply, decode), reply.result.logprobs.tolist())
    ]


def completion_body(reply: Reply, decode: Callable[[list[int]], str]) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": reply.text, "finish_reason": reply.finish_reason, "logprobs": None}
    if reply.logprobs:
        tokens = _token_strings(reply, decode)
        offsets, pos = [], 0
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        choice["logprobs"] = {
            "tokens": tokens,
            "token_logprobs": reply.result.logprobs.tolist(),
            "top_logprobs": None,
            "text_offset": offsets,
        }
    return _body(reply, "cmpl", "text_completion", choice)


def _body(reply: Reply, id_prefix: str, object_: str, choice: dict[str, Any]) -> dict[str, Any]:
    """The response envelope both endpoints share (with vLLM's ``return_token_ids`` extras)."""
    body = {
        "id": f"{id_prefix}-{reply.request_id}",
        "object": object_,
        "created": reply.created,
        "model": reply.model,
        "choices": [choice],
        "usage": _usage(reply),
    }
    if reply.return_token_ids:
        body["prompt_token_ids"] = reply.prompt_ids.tolist()
        choice["token_ids"] = reply.result.output_ids.tolist()
    return body


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def stream_chunks(reply: Reply, decode: Callable[[list[int]], str]) -> AsyncIterator[bytes]:
    """The reply as server-sent events. Generation is not token-streamed by the engine seam, so
    the content arrives in one delta after the role delta; clients assemble it the same way."""
    full = chat_body(reply, decode) if reply.kind == "chat" else completion_body(reply, decode)
    choice = full["choices"][0]
    head = {"id": full["id"], "created": full["created"], "model": full["model"]}
    if reply.kind == "chat":
        head["object"] = "chat.completion.chunk"
        yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        delta: dict[str, Any] = {}
        if choice["message"]["content"]:
            delta["content"] = choice["message"]["content"]
        if reply.tool_calls:
            delta["tool_calls"] = _tool_calls(reply, streaming=True)
        if delta:
            part: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
            if choice["logprobs"] is not None:
                part["logprobs"] = choice["logprobs"]
            if "token_ids" in choice:
                part["token_ids"] = choice["token_ids"]
            yield _sse({**head, "choices": [part]})
        yield _sse({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": reply.finish_reason}]})
    else:
        head["object"] = "text_completion"
        yield _sse({**head, "choices": [{**choice, "finish_reason": None}]})
        yield _sse({**head, "choices": [{"index": 0, "text": "", "finish_reason": reply.finish_reason, "logprobs": None}]})
    if reply.include_usage:
        yield _sse({**head, "choices": [], "usage": full["usage"]})
    yield b"data: [DONE]\n\n"


def build_app(run: Run, backend: Backend) -> Starlette:
    decode = backend.decode

    async def body_of(request: Request) -> bytes:
        return await read_body(
            request.stream(), request.headers.get("content-length"),
            max_bytes=backend.max_body_bytes, timeout_s=backend.body_timeout_s,
        )  # fmt: skip

    def _endpoint(kind: str):
        async def endpoint(request: Request) -> Response:
            try:
                body = await body_of(request)
                reply = await run(backend.handle, kind, request.path_params["sid"], request.headers.get("authorization"), body)
            except GatewayError as e:
                return _error(e)
            if reply.stream:
                return StreamingResponse(stream_chunks(reply, decode), media_type="text/event-stream")
            return _json(chat_body(reply, decode) if kind == "chat" else completion_body(reply, decode))

        return endpoint

    async def models(request: Request) -> Response:
        try:
            await run(backend.authorize, request.path_params.get("sid"), request.headers.get("authorization"))
        except GatewayError as e:
            return _error(e)
        return _json({"object": "list", "data": [{"id": backend.model_name, "object": "model", "created": 0, "owned_by": "psrl"}]})

    async def open_session(request: Request) -> Response:
        try:
            body = await body_of(request)
            return _json(await run(backend.admin_open, request.headers.get("authorization"), body), 201)
        except GatewayError as e:
            return _error(e)

    async def close_session(request: Request) -> Response:
        try:
            return _json(await run(backend.admin_close, request.headers.get("authorization"), request.path_params["sid"]))
        except GatewayError as e:
            return _error(e)

    async def not_found(request: Request, exc: Exception) -> Response:
        return _error(GatewayError(404, f"no route {request.method} {request.url.path}", "not_found_error"))

    async def bad_method(request: Request, exc: Exception) -> Response:
        return _error(GatewayError(405, f"{request.method} is not allowed on {request.url.path}", "invalid_request_error"))

    routes = [
        Route("/sessions/{sid}/v1/chat/completions", _endpoint("chat"), methods=["POST"]),
        Route("/sessions/{sid}/v1/completions", _endpoint("completions"), methods=["POST"]),
        Route("/sessions/{sid}/v1/models", models, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
    ]
    if backend.admin_token is not None:
        routes += [
            Route("/sessions", open_session, methods=["POST"]),
            Route("/sessions/{sid}", close_session, methods=["DELETE"]),
        ]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: bad_method})
