from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class TransferQueueConfig(Section):
    transport: Literal["inproc", "ipc", "tcp"] = "ipc"
    # tcp bind address. Loopback by default; for multi-host set a routable one AND curve_auth.
    host: str = "127.0.0.1"
    storage_units: int = Field(1, ge=1)
    capacity_samples: int = Field(100_000, ge=1)  # put waits beyond this; put_nowait raises WouldBlock
    max_staleness: int = Field(1, ge=0)  # eta, in policy versions
    on_stale: Literal["drop", "refill"] = "drop"  # refill: evicted groups are handed back for regeneration
    sampler: Literal["sequential", "grpo_group", "seqlen_balanced"] = "grpo_group"
    admission_batch_size: int = Field(256, ge=1)  # B in the admission formula: samples per trainer step
    request_timeout_s: float = Field(30.0, gt=0)  # a service silent this long counts as dead
    wait_slice_s: float = Field(2.0, gt=0)  # a waiting request is re-asked this often (dead-peer check)
    curve_auth: bool = False  # ZeroMQ CURVE encryption + client authentication (tcp)
    in_process: bool | None = None  # None: in-process for inproc, one process per service otherwise

    @property
    def unit_services(self) -> int:
        """Storage units started as services of their own: none for one unit, which the
        controller's process holds (a put and a ``get_batch`` are then one round trip each)."""
        return self.storage_units if self.storage_units > 1 else 0
