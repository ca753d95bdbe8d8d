"""Backends by name: ``SANDBOX_BACKENDS`` maps ``spec.backend`` to a class taking the spec.

A kubernetes backend plugs in here: a class with ``create`` / ``reap_stale`` / ``aclose``
(``SandboxBackend``), registered under its name or named in the config by its dotted path.
"""

from __future__ import annotations

from psrl.config.sandbox import SandboxSpec
from psrl.registry import Registry

from .base import Sandbox, SandboxBackend

SANDBOX_BACKENDS: Registry = Registry("sandbox backend")
register_sandbox_backend = SANDBOX_BACKENDS.register

SANDBOX_BACKENDS.add("bubblewrap", "psrl.sandboxes.bubblewrap:BubblewrapBackend")
SANDBOX_BACKENDS.add("docker", "psrl.sandboxes.docker:DockerBackend")


def make_backend(spec: SandboxSpec) -> SandboxBackend:
    """The backend ``spec.backend`` names, built for ``spec`` (checks the host; starts nothing)."""
    return SANDBOX_BACKENDS.get(spec.backend)(spec)


class _OwningSandbox:
    """A sandbox that also closes the backend it came from (for one-off use)."""

    def __init__(self, sandbox: Sandbox, backend: SandboxBackend) -> None:
        self._sb = sandbox
        self._backend = backend

    def __getattr__(self, name: str):  # exec, write_file, read_file, upload_dir, reset, ...
        return getattr(self._sb, name)

    async def aclose(self) -> None:
        try:
            await self._sb.aclose()
        finally:
            await self._backend.aclose()

    async def __aenter__(self) -> _OwningSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def open_sandbox(spec: SandboxSpec) -> Sandbox:
    """One sandbox of ``spec``, outside any pool: ``async with await open_sandbox(spec) as sb``.

    Rollouts should take theirs from a ``SandboxPool`` instead (warm, capped, reaped)."""
    backend = make_backend(spec)
    try:
        sandbox = await backend.create()
    except BaseException:
        await backend.aclose()
        raise
    return _OwningSandbox(sandbox, backend)  # type: ignore[return-value]
