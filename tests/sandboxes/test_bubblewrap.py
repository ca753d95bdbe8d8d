"""What is particular to the bubblewrap backend and to the config/factory seam."""

from __future__ import annotations

import pydantic
import pytest

from psrl.config.sandbox import SandboxSpec
from psrl.registry import UnknownNameError
from psrl.sandboxes import SandboxError, make_backend, open_sandbox

from .helpers import BACKENDS, sandbox, spec_for

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def test_process_limit_counts_per_sandbox():
    """Two sandboxes near their limit at once: neither starves the other."""
    import anyio

    limits = {"processes": 24}
    results = []
    async with sandbox("bubblewrap", limits=limits) as (backend, a):
        b = await backend.create()
        try:
            async def run(sb):
                results.append(await sb.exec("for i in $(seq 16); do sleep 1 & done; wait; echo done"))

            async with anyio.create_task_group() as tg:
                tg.start_soon(run, a)
                tg.start_soon(run, b)
            over = await a.exec("for i in $(seq 40); do sleep 1 & done 2>&1; wait")
        finally:
            await b.aclose()
    assert [r.stdout for r in results] == ["done\n", "done\n"], results
    assert "fork" in (over.stdout + over.stderr).lower()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_python_runs_inside(backend):
    async with sandbox(backend) as (_, sb):
        await sb.write_file("solve.py", "import math\nprint(math.comb(10, 3))\n")
        assert (await sb.exec("python3 solve.py")).stdout == "120\n"
        r = await sb.exec("python3 -c 'import sys; print(sys.argv[1:])' a b")
        assert r.stdout == "['a', 'b']\n"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_memory_limit(backend):
    async with sandbox(backend, limits={"memory_mb": 128}) as (_, sb):
        r = await sb.exec("python3 -c 'x = bytearray(512 << 20); print(len(x))'")
        assert r.exit_code not in (0, None) and "536870912" not in r.stdout
        assert (await sb.exec("python3 -c 'x = bytearray(8 << 20); print(len(x))'")).stdout == "8388608\n"


def test_unknown_backend_is_a_config_error():
    with pytest.raises(pydantic.ValidationError, match="unknown sandbox backend 'bubblewarp'"):
        SandboxSpec(backend="bubblewarp")
    with pytest.raises(UnknownNameError, match="could not be imported"):
        make_backend(SandboxSpec(backend="no_such_pkg.Backend"))


def test_missing_workspace_is_named():
    with pytest.raises(SandboxError, match="/no/such/dir"):
        make_backend(SandboxSpec(workspace="/no/such/dir"))


async def test_open_sandbox_outside_a_pool(tmp_path):
    async with await open_sandbox(spec_for("bubblewrap", state_dir=str(tmp_path))) as sb:
        assert (await sb.exec("echo hi")).stdout == "hi\n"
        host_dir = sb.host_dir
        assert host_dir.exists()
    assert not host_dir.exists()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_cancel_at_any_moment_leaves_nothing(backend):
    """Cancel execs at random moments, setup included: nothing may be left running."""
    import random

    import anyio

    rng = random.Random(4)
    async with sandbox(backend) as (_, sb):
        for _ in range(25):
            with anyio.move_on_after(rng.uniform(0, 0.03)):
                await sb.exec("sleep 0.05 & sleep 30")
            assert await sb.leftover_processes() == []
        assert (await sb.exec("echo ok")).stdout == "ok\n"
