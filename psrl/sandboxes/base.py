"""The sandbox seam: an isolated filesystem + process space for one rollout."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class ExecResult:
    exit_code: int | None  # None when killed before it exited (timeout, output over the limit)
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False  # stdout or stderr was cut at the output limit
    duration_s: float = 0.0


class SandboxError(RuntimeError):
    """The sandbox itself failed or was misused (not: the command inside failed)."""


@runtime_checkable
class Sandbox(Protocol):
    """Commands run as ``sh -c cmd`` inside; the workspace is ``/workspace``.

    ``exec`` never raises for what the command does (non-zero exit, timeout, huge output): the
    result says so. Output beyond ``limits.output_bytes`` per stream makes the command be killed
    and the result ``truncated``. Nothing a command starts outlives its ``exec``; files in
    ``/workspace`` and ``/tmp`` persist until ``reset()`` or ``aclose()``. Calls on one sandbox run
    one at a time. Paths given to the file methods are absolute inside the sandbox or relative to
    ``/workspace``. ``aclose()`` kills every process inside and removes every trace on the host;
    it is idempotent.
    """

    async def exec(
        self,
        cmd: str,
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str = "/workspace",
    ) -> ExecResult: ...

    async def write_file(self, path: str, data: bytes | str) -> None: ...

    async def read_file(self, path: str) -> bytes: ...

    async def upload_dir(self, src: str, dst: str) -> None: ...

    async def reset(self) -> None:
        """Back to the state right after start: the workspace as given, /tmp empty."""
        ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class ReapReport:
    """What a start-up sweep removed, left by runs that died without closing their sandboxes."""

    processes: int = 0
    dirs: int = 0
    containers: int = 0
    volumes: int = 0

    def __add__(self, other: ReapReport) -> ReapReport:
        return ReapReport(
            self.processes + other.processes, self.dirs + other.dirs,
            self.containers + other.containers, self.volumes + other.volumes,
        )

    @property
    def total(self) -> int:
        return self.processes + self.dirs + self.containers + self.volumes


@runtime_checkable
class SandboxBackend(Protocol):
    """Makes sandboxes of one spec; holds what they share (e.g. the Docker client).

    A backend is registered by name in ``SANDBOX_BACKENDS`` (bubblewrap, docker; a kubernetes one
    plugs in the same way) and built with ``make_backend(spec)``.
    """

    async def create(self) -> Sandbox: ...

    async def reap_stale(self) -> ReapReport:
        """Remove what crashed earlier runs of this backend left behind; live owners are spared."""
        ...

    async def aclose(self) -> None: ...
