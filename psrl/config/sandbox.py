from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class SandboxLimits(Section):
    cpu_seconds: int = Field(30, ge=1)
    memory_mb: int = Field(1024, ge=16)
    processes: int = Field(128, ge=1)
    file_size_mb: int = Field(64, ge=1)
    open_files: int = Field(256, ge=16)
    output_bytes: int = Field(65536, ge=1)  # per stream, per command
    wall_seconds: float = Field(30.0, gt=0)  # per command


class SandboxSpec(Section):
    """What every rollout's sandbox looks like. ``backend`` picks the implementation."""

    backend: Literal["bubblewrap", "docker"] = "bubblewrap"
    image: str = "psrl-sandbox:latest"  # docker image
    root: str | None = None  # bubblewrap: a root filesystem dir; None = the host's /usr, read-only
    workspace: str | None = None  # a dir copied (overlaid) into /workspace of each sandbox
    network: bool = False
    limits: SandboxLimits = SandboxLimits()


class SandboxPoolConfig(Section):
    warm: int = Field(4, ge=0)  # sandboxes kept ready per spec
    max_concurrency: int = Field(64, ge=1)
    max_creates_per_s: float = Field(50.0, gt=0)


class SandboxConfig(Section):
    spec: SandboxSpec = SandboxSpec()
    pool: SandboxPoolConfig = SandboxPoolConfig()
