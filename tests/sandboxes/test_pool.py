"""SandboxPool: warm, reset on release, capped, rate-limited, leak-free under cancellation, and it
reaps what a crashed earlier run left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import anyio
import pytest

from psrl.config.sandbox import SandboxPoolConfig
from psrl.sandboxes import SandboxError, SandboxPool, make_backend

from .helpers import BACKENDS, require, spec_for

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]


def _our_dirs(state_dir) -> list[str]:
    return sorted(n for n in os.listdir(state_dir) if n.startswith("sb-"))


async def test_warm_pool_reuses_and_resets(tmp_path):
    spec = spec_for("bubblewrap", state_dir=str(tmp_path / "state"))
    async with SandboxPool(spec, SandboxPoolConfig(warm=2)) as pool:
        assert (pool.statistics().idle, pool.statistics().created) == (2, 2)
        async with pool.acquire() as sb:
            await sb.write_file("left.txt", "x")
            assert (await sb.exec("echo y > /tmp/t; cat left.txt")).stdout == "x"
        for _ in range(3):
            async with pool.acquire() as sb:
                r = await sb.exec("ls -A /workspace /tmp")
                assert "left.txt" not in r.stdout and "t\n" not in r.stdout
        stats = pool.statistics()
        assert (stats.created, stats.reused, stats.idle, stats.in_use) == (2, 4, 2, 0)
        assert len(_our_dirs(tmp_path / "state")) == 2
    assert _our_dirs(tmp_path / "state") == []


async def test_a_failed_reset_is_logged_counted_and_not_reused(tmp_path):
    from structlog.testing import capture_logs

    spec = spec_for("bubblewrap", state_dir=str(tmp_path / "state"))
    async with SandboxPool(spec, SandboxPoolConfig(warm=1)) as pool:
        with capture_logs() as logs:
            async with pool.acquire() as sb:
                etc = sb._dirs["etc"]  # the reset rewrites etc/; a file in its place makes it fail
                for f in etc.iterdir():
                    f.unlink()
                etc.rmdir()
                etc.write_text("not a directory")
        stats = pool.statistics()
        assert (stats.reset_failures, stats.idle, stats.closed) == (1, 0, 1)
        assert stats.metrics()["sandbox/reset_failures"] == 1.0
        warned = [e for e in logs if e["log_level"] == "warning"]
        assert len(warned) == 1 and "reset failed" in warned[0]["event"] and "FileExistsError" in warned[0]["error"]
        async with pool.acquire() as sb:  # the pool makes a fresh one
            assert (await sb.exec("echo ok")).stdout.strip() == "ok"
        assert pool.statistics().created == 2
    assert _our_dirs(tmp_path / "state") == []


async def test_concurrency_cap_and_creation_rate(tmp_path):
    spec = spec_for("bubblewrap", state_dir=str(tmp_path / "state"))
    cfg = SandboxPoolConfig(warm=0, max_concurrency=2, max_creates_per_s=20.0)
    peak = now = 0
    async with SandboxPool(spec, cfg) as pool:

        async def use() -> None:
            nonlocal peak, now
            async with pool.acquire() as sb:
                now += 1
                peak = max(peak, now)
                await sb.exec("sleep 0.1")
                now -= 1

        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(use)
        elapsed = time.monotonic() - t0
        assert peak == 2
        # warm=0: every acquire creates, and six creations at 20/s span at least 5 intervals
        assert pool.statistics().created == 6 and elapsed >= 5 / 20 - 0.01
    assert _our_dirs(tmp_path / "state") == []


async def test_cancelling_a_batch_releases_everything(tmp_path):
    spec = spec_for("bubblewrap", state_dir=str(tmp_path / "state"))
    held = []
    async with SandboxPool(spec, SandboxPoolConfig(warm=1)) as pool:
        with anyio.move_on_after(1.0):
            async with anyio.create_task_group() as tg:
                for _ in range(4):

                    async def rollout() -> None:
                        async with pool.acquire() as sb:
                            held.append(sb)
                            await sb.exec("sleep 100", timeout=60)

                    tg.start_soon(rollout)
        stats = pool.statistics()
        assert stats.in_use == 0 and stats.idle == 1
        for sb in held:
            assert await sb.leftover_processes() == []
        assert len(_our_dirs(tmp_path / "state")) == 1  # the warm one
    assert _our_dirs(tmp_path / "state") == []


async def test_aclose_ends_commands_still_running(tmp_path):
    spec = spec_for("bubblewrap", state_dir=str(tmp_path / "state"))
    pool = SandboxPool(spec, SandboxPoolConfig(warm=0))
    await pool.start()
    errors = []

    async def rollout() -> None:
        try:
            async with pool.acquire() as sb:
                await sb.exec("sleep 100", timeout=60)
        except SandboxError as e:
            errors.append(e)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(rollout)
            await anyio.sleep(0.5)
            await pool.aclose()
    assert len(errors) == 1 and "closed" in str(errors[0])
    assert _our_dirs(tmp_path / "state") == []
    with pytest.raises(SandboxError, match="closed"):
        async with pool.acquire():
            pass


_CRASHER = textwrap.dedent("""
    import anyio, sys
    from psrl.config.sandbox import SandboxSpec
    from psrl.sandboxes import make_backend

    async def main():
        spec = SandboxSpec.model_validate_json(sys.argv[1])
        backend = make_backend(spec)
        sb = await backend.create()
        print("ready", flush=True)
        await sb.exec("sleep 1000", timeout=600)

    anyio.run(main)
""")


def _crash_a_run(spec) -> None:
    """A run that holds a sandbox mid-command and dies by SIGKILL, closing nothing."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _CRASHER, spec.model_dump_json()], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # its command is running now
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_start_reaps_what_a_crashed_run_left(backend, tmp_path):
    require(backend)
    spec = spec_for(backend, state_dir=str(tmp_path / "state"))
    await anyio.to_thread.run_sync(_crash_a_run, spec)
    live_backend = make_backend(spec)
    live = await live_backend.create()  # a live owner's sandbox must survive the sweep
    try:
        if backend == "bubblewrap":
            assert len(_our_dirs(tmp_path / "state")) == 2
            # A stray process of the dead run (as if --die-with-parent had been missed).
            dead_dir = next(d for d in _our_dirs(tmp_path / "state") if d != live.host_dir.name)
            stray = subprocess.Popen(
                [sys.executable, "-c", "import time; time.sleep(600)", f"{tmp_path}/state/{dead_dir}/x"]
            )
        async with SandboxPool(spec, SandboxPoolConfig(warm=0)) as pool:
            reaped = pool.statistics().reaped
        if backend == "bubblewrap":
            assert reaped.dirs == 1 and reaped.processes >= 1
            assert stray.wait(timeout=5) == -signal.SIGKILL
            assert _our_dirs(tmp_path / "state") == [live.host_dir.name]
        else:
            assert reaped.containers == 1
        assert (await live.exec("echo alive")).stdout == "alive\n"
    finally:
        await live.aclose()
        await live_backend.aclose()
