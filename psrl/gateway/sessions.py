"""Sessions: who may call, what they may ask for, and what their calls produced.

All session state lives on the event loop that owns the gateway; the HTTP layer hands each
request over whole (session id, Authorization header, raw body) and gets back a finished reply.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import numpy as np

from psrl.engines.base import (
    FinishReason,
    GenerateRequest,
    GenerateResult,
    InferenceEngine,
    SamplingParams,
)

from .capture import CapturedCall, SessionCapture
from .chat_tokens import BuiltPrompt, ChatTokenizer, PromptBuilder
from .limits import Offload, check_model, check_prompt_length, prompt_ids
from .tool_calls import ExtractedCall, HermesToolParser, ToolParser, openai_calls
from .wire import ChatCompletionRequest, CompletionRequest, GatewayError, parse_body

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionInfo:
    """What an agent needs: ``base_url`` is an OpenAI ``base_url`` (it ends in ``/v1``)."""

    session_id: str
    token: str
    base_url: str


@dataclass
class Session:
    id: str
    token: str
    sampling: SamplingParams
    lock_sampling: bool  # True: the session's temperature/top-p/top-k/seed win over the request's
    max_calls: int | None
    capture: SessionCapture
    prompts: PromptBuilder
    calls_started: int = 0
    closed_reason: str | None = None
    in_flight: set[str] = field(default_factory=set)
    opened_s: float = field(default_factory=time.monotonic)
    last_active_s: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Reply:
    """A finished call, ready to be written as JSON or as server-sent events."""

    kind: str  # "chat" | "completions"
    request_id: str
    created: int
    model: str
    prompt_ids: np.ndarray
    result: GenerateResult
    text: str  # chat: the content without tool calls; completions: the generated text
    tool_calls: list[ExtractedCall]
    finish_reason: str
    logprobs: bool
    return_token_ids: bool
    stream: bool
    include_usage: bool


class SessionTable:
    """Open and closed sessions, token checks, and the handling of one call."""

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: ChatTokenizer,
        *,
        model_name: str,
        base_url: Callable[[], str],
        default_sampling: SamplingParams | None = None,
        tool_parser: ToolParser | None = None,
        max_closed: int = 100_000,
        model_aliases: tuple[str, ...] = (),
        max_model_len: int | None = None,
        offload: Offload | None = None,
    ) -> None:
        self.engine = engine
        self.tok = tokenizer
        self.model_name = model_name
        self._base_url = base_url
        self.default_sampling = default_sampling or SamplingParams()
        self.tool_parser = tool_parser or HermesToolParser()
        self.model_aliases = tuple(model_aliases)
        self.max_model_len = max_model_len
        self.vocab_size = len(tokenizer.hf)
        self.offload = offload or Offload(workers=4, min_chars=16_384)
        self.tool_call_errors = 0  # calls the model wrote that no parser could read
        # Awaited with each session's capture as it closes (``psrl serve`` writes it to parquet).
        self.on_close: Callable[[SessionCapture], Awaitable[None]] | None = None
        self._by_id: dict[str, Session] = {}
        self._by_token: dict[str, Session] = {}
        self._max_closed = max_closed
        self._closed_order: list[str] = []

    # ---- lifecycle ----------------------------------------------------------------------

    def open(
        self,
        session_id: str | None = None,
        *,
        sampling: SamplingParams | None = None,
        lock_sampling: bool = False,
        max_calls: int | None = None,
    ) -> SessionInfo:
        sid = session_id or secrets.token_hex(8)
        if not sid.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise ValueError(f"session id {sid!r} may hold only letters, digits, '-', '_' and '.'")
        if sid in self._by_id:
            raise ValueError(f"session {sid!r} already exists")
        if max_calls is not None and max_calls < 1:
            raise ValueError(f"max_calls must be >= 1, got {max_calls}")
        token = secrets.token_urlsafe(24)
        session = Session(
            id=sid,
            token=token,
            sampling=sampling or self.default_sampling,
            lock_sampling=lock_sampling,
            max_calls=max_calls,
            capture=SessionCapture(sid),
            prompts=PromptBuilder(self.tok),
        )
        self._by_id[sid] = session
        self._by_token[token] = session
        return SessionInfo(sid, token, f"{self._base_url()}/sessions/{sid}/v1")

    def get(self, session_id: str) -> Session:
        try:
            return self._by_id[session_id]
        except KeyError:
            raise KeyError(f"no session {session_id!r}") from None

    async def close(self, session_id: str, reason: str = "closed") -> SessionCapture:
        """Later calls get 410; calls still generating are aborted. Closing twice is a no-op."""
        session = self.get(session_id)
        if session.closed_reason is None:
            session.closed_reason = session.capture.closed_reason = reason
            self._closed_order.append(session_id)
            for rid in list(session.in_flight):
                await self.engine.abort(rid)
            end = getattr(self.engine, "end_session", None)  # a Router forgets the sticky pin
            if callable(end):
                end(session_id)
            self._forget_old()
            if self.on_close is not None:
                await self.on_close(session.capture)
        return session.capture

    async def close_idle(self, idle_s: float) -> list[str]:
        """Close the open sessions that made no call for ``idle_s`` seconds (none in flight)."""
        now = time.monotonic()
        idle = [
            s.id for s in self._by_id.values()
            if s.closed_reason is None and not s.in_flight and now - s.last_active_s >= idle_s
        ]  # fmt: skip
        for sid in idle:
            await self.close(sid, f"idle for {idle_s:g} s")
        return idle

    def _forget_old(self) -> None:
        # Closed sessions are kept (for 410 and for reading their capture) up to a bound.
        while len(self._closed_order) > self._max_closed:
            old = self._by_id.pop(self._closed_order.pop(0), None)
            if old is not None:
                self._by_token.pop(old.token, None)

    def all(self) -> list[Session]:
        return list(self._by_id.values())

    def open_sessions(self) -> int:
        return sum(1 for s in self._by_id.values() if s.closed_reason is None)

    # ---- one call -----------------------------------------------------------------------

    def authorize(self, session_id: str | None, authorization: str | None) -> Session:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise GatewayError(401, "missing bearer token: send 'Authorization: Bearer <session token>'", "authentication_error")
        session = self._by_token.get(token.strip())
        if session is None or not secrets.compare_digest(session.token, token.strip()):
            raise GatewayError(401, "invalid session token", "authentication_error")
        if session_id is not None and session_id != session.id:
            # Do not reveal whether another session exists.
            raise GatewayError(404, f"no session {session_id!r} for this token", "not_found_error")
        if session.closed_reason is not None:
            raise GatewayError(410, f"session {session.id!r} is closed: {session.closed_reason}", "session_closed")
        return session

    def warm_up(self) -> None:
        """The text path once before serving (request parsing, the chat template, tokenizer and
        detokenizer): the template compiles and the caches fill here, not in the first agents'
        calls, and ``gc_freeze`` then takes what they built out of the collector's scans."""
        body = b'{"messages": [{"role": "user", "content": "warm-up"}]}'
        req = parse_body(ChatCompletionRequest, body)
        try:
            prompt = PromptBuilder(self.tok).build_chat([m.template_dict() for m in req.messages], req.tool_dicts())
        except Exception as e:  # noqa: BLE001 - a template may reject a lone user message; calls will say why
            log.warning("gateway warm-up skipped: the chat template failed on one user message: %s", e)
            return
        self.tok.decode(prompt.ids)

    async def handle(self, kind: str, session_id: str, authorization: str | None, body: bytes) -> Reply:
        session = self.authorize(session_id, authorization)
        session.last_active_s = time.monotonic()
        model = ChatCompletionRequest if kind == "chat" else CompletionRequest
        req = await self.offload.run(len(body), parse_body, model, body)
        check_model(req.model, self.model_name, self.model_aliases)
        if kind == "chat":
            return await self._chat(session, req, len(body))
        return await self._complete(session, req, len(body))

    async def _chat(self, session: Session, req: ChatCompletionRequest, size: int) -> Reply:
        messages = [m.template_dict() for m in req.messages]
        tools = req.tool_dicts()
        try:
            prompt = await self.offload.run(size, session.prompts.build_chat, messages, tools)
        except Exception as e:  # noqa: BLE001 - a template may raise anything on messages it rejects
            raise GatewayError(400, f"chat template failed on these messages: {e}") from None
        check_prompt_length(len(prompt.ids), self.max_model_len, "messages")
        result = await self._generate(session, prompt.ids, self._sampling(session, req), "chat")
        text = await self._decode(result.output_ids)
        content, calls = (text, [])
        if tools:
            action = self.tool_parser.parse(await self._text_for_parser(result.output_ids, text))
            content, calls = openai_calls(action)
            self.tool_call_errors += len(action.errors)
            session.capture.tool_call_errors += len(action.errors)
        # The assistant message as the agent will send it back (see ChatMessage.template_dict).
        reply_dict: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            reply_dict["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
            ]
        session.prompts.remember_chat(messages, tools, prompt, result.output_ids, reply_dict)
        finish = "tool_calls" if calls else _finish(result)
        return self._reply("chat", req, prompt, result, content, calls, finish, req.logprobs)

    async def _complete(self, session: Session, req: CompletionRequest, size: int) -> Reply:
        if isinstance(req.prompt, str):
            prompt = await self.offload.run(size, session.prompts.build_text, req.prompt)
        else:
            prompt = BuiltPrompt(prompt_ids(req.prompt, self.vocab_size), "", False)
        check_prompt_length(len(prompt.ids), self.max_model_len, "prompt")
        result = await self._generate(session, prompt.ids, self._sampling(session, req), "completions")
        text = await self._decode(result.output_ids)
        if isinstance(req.prompt, str):
            session.prompts.remember_text(prompt, result.output_ids, text)
        return self._reply("completions", req, prompt, result, text, [], _finish(result), bool(req.logprobs))

    async def _text_for_parser(self, ids: np.ndarray, text: str) -> str:
        if not getattr(self.tool_parser, "keeps_special_tokens", False):
            return text
        if len(ids) and int(ids[-1]) in self.tok.eos_ids:
            ids = ids[:-1]
        return await self.offload.run(4 * len(ids), partial(self.tok.decode, skip_special=False), ids)

    async def _decode(self, ids: np.ndarray) -> str:
        return await self.offload.run(4 * len(ids), self.tok.decode, ids)  # ~4 characters a token

    def _reply(self, kind, req, prompt, result, text, calls, finish, logprobs) -> Reply:
        opts = req.stream_options
        return Reply(
            kind=kind,
            request_id=result.request_id,
            created=int(time.time()),
            model=req.model or self.model_name,
            prompt_ids=prompt.ids,
            result=result,
            text=text,
            tool_calls=calls,
            finish_reason=finish,
            logprobs=logprobs,
            return_token_ids=req.return_token_ids,
            stream=req.stream,
            include_usage=bool(opts and opts.include_usage),
        )

    def _sampling(self, session: Session, req: ChatCompletionRequest | CompletionRequest) -> SamplingParams:
        base = session.sampling
        limit = req.token_limit()
        changes: dict[str, Any] = {
            "max_tokens": min(limit, base.max_tokens) if limit else base.max_tokens,
            "stop": base.stop + req.stop_strings(),
            "stop_token_ids": base.stop_token_ids + tuple(req.stop_token_ids or ()),
            "logprobs": True,  # always captured, whether or not the agent asked to see them
        }
        if not session.lock_sampling:
            for name in ("temperature", "top_p", "top_k", "seed"):
                value = getattr(req, name)
                if value is not None:
                    changes[name] = value
        return replace(base, **changes)

    async def _generate(self, session: Session, prompt_ids: np.ndarray, sampling: SamplingParams, kind: str) -> GenerateResult:
        if session.max_calls is not None and session.calls_started >= session.max_calls:
            await self.close(session.id, f"turn limit of {session.max_calls} calls reached")
            raise GatewayError(410, f"session {session.id!r} is closed: {session.closed_reason}", "session_closed")
        session.calls_started += 1
        request = GenerateRequest(prompt_ids, sampling, session_id=session.id)
        session.in_flight.add(request.request_id)
        start = time.perf_counter()
        try:
            result = await self.engine.generate(request)
        finally:
            session.in_flight.discard(request.request_id)
        if session.closed_reason is not None:
            # Closed while generating: the agent never receives this turn, so it is not captured.
            raise GatewayError(410, f"session {session.id!r} is closed: {session.closed_reason}", "session_closed")
        if result.finish_reason == FinishReason.ERROR:
            session.capture.failed_calls += 1
            raise GatewayError(400, f"the engine rejected the request: {result.error}", "engine_error")
        if result.finish_reason == FinishReason.ABORT:
            session.capture.failed_calls += 1
            raise GatewayError(503, "the engine aborted this request; retry it", "engine_aborted")
        session.capture.record(
            CapturedCall(
                index=len(session.capture.calls),
                request_id=request.request_id,
                endpoint=kind,
                prompt_ids=request.prompt_ids,
                output_ids=np.asarray(result.output_ids, np.int32),
                logprobs=np.asarray(result.logprobs, np.float32),
                versions=np.asarray(result.versions, np.int32),
                finish_reason=result.finish_reason,
                latency_s=time.perf_counter() - start,
            )
        )
        return result


def _finish(result: GenerateResult) -> str:
    return "length" if result.finish_reason == FinishReason.LENGTH else "stop"
