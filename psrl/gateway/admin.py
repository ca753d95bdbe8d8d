"""The admin side of ``psrl serve``: open and close sessions over HTTP with an admin token."""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Any

from pydantic import Field

from psrl.engines.base import SamplingParams

from .capture import SessionCapture
from .wire import GatewayError, _Strict, parse_body


class SamplingBody(_Strict):
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None


class OpenSessionBody(_Strict):
    """``POST /sessions``: every field optional (``{}`` opens a session with the defaults)."""

    session_id: str | None = None
    max_calls: int | None = Field(None, ge=1)
    lock_sampling: bool = False  # the session's sampling wins over what the agent sends
    sampling: SamplingBody | None = None


def check_admin(expected: str | None, authorization: str | None) -> None:
    scheme, _, token = (authorization or "").partition(" ")
    if expected is None or scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), expected):
        raise GatewayError(401, "this endpoint needs 'Authorization: Bearer <admin token>' (printed by psrl serve)", "authentication_error")


def parse_open(body: bytes, default: SamplingParams) -> tuple[OpenSessionBody, SamplingParams]:
    req: OpenSessionBody = parse_body(OpenSessionBody, body or b"{}")
    sampling = default
    if req.sampling is not None:
        changes = {k: v for k, v in req.sampling.model_dump().items() if v is not None}
        sampling = replace(default, **changes)
    return req, sampling


def closed_summary(capture: SessionCapture) -> dict[str, Any]:
    return {
        "session_id": capture.session_id,
        "calls": capture.num_calls,
        "failed_calls": capture.failed_calls,
        "tool_call_errors": capture.tool_call_errors,
        "closed_reason": capture.closed_reason,
    }
