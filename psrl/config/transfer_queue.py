from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class TransferQueueConfig(Section):
    transport: Literal["inproc", "ipc", "tcp"] = "ipc"
    host: str = "127.0.0.1"
    storage_units: int = Field(1, ge=1)
    capacity_samples: int = Field(100_000, ge=1)  # put waits beyond this
    max_staleness: int = Field(1, ge=0)  # eta, in policy versions
    on_stale: Literal["drop", "refill"] = "drop"
    sampler: Literal["sequential", "grpo_group", "seqlen_balanced"] = "grpo_group"
    request_timeout_s: float = Field(30.0, gt=0)
    curve_auth: bool = False
