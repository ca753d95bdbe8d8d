"""The sandbox seam: an isolated filesystem + process space for one rollout."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class ExecResult:
    exit_code: int | None  # None when killed before it exited
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False  # stdout or stderr was cut at the output limit
    duration_s: float = 0.0


@runtime_checkable
class Sandbox(Protocol):
    """Commands run as ``sh -c cmd`` inside; the workspace is ``/workspace``.

    ``exec`` never raises for what the command does (non-zero exit, timeout, huge output): the
    result says so. ``aclose()`` kills every process inside and removes every trace on the host.
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

    async def aclose(self) -> None: ...
