"""Both backends pass ``check_sandbox``; the suite itself catches a broken sandbox."""

from __future__ import annotations

import pytest

from psrl.sandboxes import make_backend
from psrl.testing.conformance_env import ConformanceError
from psrl.testing.conformance_sandbox import check_sandbox

from .helpers import BACKENDS, require, spec_for

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_backend_passes_check_sandbox(backend):
    require(backend)
    b = make_backend(spec_for(backend))
    try:
        await check_sandbox(b.create)
    finally:
        await b.aclose()


class _DropsEnv:
    """A real sandbox whose exec forgets the caller's env: the suite must notice."""

    def __init__(self, inner):
        self._inner = inner

    async def exec(self, cmd, *, timeout=None, env=None, cwd="/workspace"):
        return await self._inner.exec(cmd, timeout=timeout, cwd=cwd)

    def __getattr__(self, name):
        return getattr(self._inner, name)


async def test_check_sandbox_rejects_a_sandbox_that_ignores_env():
    b = make_backend(spec_for("bubblewrap"))

    async def factory():
        return _DropsEnv(await b.create())

    try:
        with pytest.raises(ConformanceError, match="env must pass"):
            await check_sandbox(factory)
    finally:
        await b.aclose()
