from __future__ import annotations

from pydantic import Field, field_validator

from .base import Section

# Backends that ship with PSRL. Others (a kubernetes one, a user's) are named by a dotted path to a
# class, or registered in psrl.sandboxes.SANDBOX_BACKENDS before the config is used.
BUILTIN_SANDBOX_BACKENDS = ("bubblewrap", "docker")


class SandboxLimits(Section):
    cpu_seconds: int = Field(30, ge=1)  # per process (RLIMIT_CPU)
    memory_mb: int = Field(1024, ge=16)  # bubblewrap: address space per process; docker: the container
    processes: int = Field(128, ge=1)  # at once, in the sandbox
    file_size_mb: int = Field(64, ge=1)  # largest file a command may write
    open_files: int = Field(256, ge=16)
    output_bytes: int = Field(65536, ge=1)  # per stream, per command; beyond it the command is killed
    wall_seconds: float = Field(30.0, gt=0)  # per command, when exec() is given no timeout


class SandboxSpec(Section):
    """What every rollout's sandbox looks like. ``backend`` picks the implementation."""

    backend: str = "bubblewrap"  # bubblewrap | docker | a dotted path to a SandboxBackend class
    image: str = "psrl-sandbox:latest"  # docker image
    root: str | None = None  # bubblewrap: a root filesystem dir; None = the host's /usr, read-only
    workspace: str | None = None  # a dir copied (overlaid) into /workspace of each sandbox
    network: bool = False
    limits: SandboxLimits = SandboxLimits()
    # bubblewrap: where per-sandbox dirs and ownership records live on the host.
    # None = $XDG_RUNTIME_DIR/psrl-sandboxes, else /tmp/psrl-sandboxes-<uid>.
    state_dir: str | None = None
    docker_host: str | None = None  # None = $DOCKER_HOST, else the default local socket

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        if v in BUILTIN_SANDBOX_BACKENDS or "." in v or ":" in v:
            return v
        raise ValueError(
            f"unknown sandbox backend {v!r}; known: {', '.join(BUILTIN_SANDBOX_BACKENDS)},"
            " or a dotted path such as my_pkg.sandboxes.MyBackend"
        )


class SandboxPoolConfig(Section):
    warm: int = Field(4, ge=0)  # sandboxes kept ready per spec
    max_concurrency: int = Field(64, ge=1)  # sandboxes handed out at once; acquire() waits beyond
    max_creates_per_s: float = Field(50.0, gt=0)


class SandboxConfig(Section):
    spec: SandboxSpec = SandboxSpec()
    pool: SandboxPoolConfig = SandboxPoolConfig()
