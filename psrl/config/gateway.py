"""The session gateway as a server: input limits, worker threads, names, timeouts."""

from __future__ import annotations

import ipaddress

from pydantic import Field, field_validator

from .base import Section


class GatewayConfig(Section):
    """Read by ``psrl serve`` and by every gateway PSRL opens (the ``mini_swe_agent`` loop's too)."""

    host: str = "127.0.0.1"  # loopback only: the gateway refuses any other address
    port: int = Field(0, ge=0, le=65535)  # 0: a free port
    model_name: str = "psrl-policy"  # what /v1/models lists and replies carry
    # Other names a client may send as ``model`` (a harness configured for "gpt-4o", say);
    # any other name gets 404, as vLLM's server answers.
    model_aliases: list[str] = []
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)  # larger bodies get 413, unread
    # Threads that run chat templating, tokenization and detokenization of large inputs, so one
    # heavy request never stalls the event loop that serves every other session.
    tokenizer_workers: int = Field(4, ge=1)
    # Inputs below this many characters are tokenized on the loop: a thread hop costs more than
    # the work (benchmarks/gateway.py: the p99 of small calls).
    offload_min_chars: int = Field(16_384, ge=0)
    session_idle_timeout_s: float = Field(1800.0, gt=0)  # ``psrl serve``: sessions idle this long close
    # A client must send its request head (and each later one on a keep-alive connection) within
    # this many seconds, and the body within ``body_timeout_s``: slow or stalled clients are cut off.
    header_timeout_s: float = Field(30.0, gt=0)
    body_timeout_s: float = Field(60.0, gt=0)
    keep_alive_timeout_s: float = Field(30.0, gt=0)
    # The collector's young generations scan every object alive at each collection; freezing
    # what start-up built (torch, transformers, the engine) moves it out of those scans once the
    # gateway serves (added-latency p99 66-80 ms -> under 20 ms in benchmarks/gateway.py).
    gc_freeze: bool = True

    @field_validator("host")
    @classmethod
    def _loopback(cls, v: str) -> str:
        try:
            loopback = ipaddress.ip_address(v).is_loopback
        except ValueError:
            raise ValueError(f"{v!r} is not an IP address; the gateway binds a loopback address such as 127.0.0.1") from None
        if not loopback:
            raise ValueError("the gateway binds loopback only (its sessions carry bearer tokens over plain HTTP)")
        return v
