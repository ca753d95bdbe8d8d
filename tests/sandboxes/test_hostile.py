"""Hostile and bad input, on both backends: each is contained, reported, and the host unchanged."""

from __future__ import annotations

import os
import secrets

import anyio
import psutil
import pytest

from .helpers import BACKENDS, sandbox

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90), pytest.mark.parametrize("backend", BACKENDS)]

LIMITS = {"processes": 48, "file_size_mb": 1, "output_bytes": 65536, "memory_mb": 512}


async def _still_fine(sb) -> None:
    """The sandbox still works and nothing of the hostile command is left running."""
    r = await sb.exec("echo alive")
    assert (r.exit_code, r.stdout) == (0, "alive\n")
    assert await sb.leftover_processes() == []


async def test_fork_bomb_is_contained(backend):
    async with sandbox(backend, limits=LIMITS) as (_, sb):
        host_before = len(psutil.pids())
        with anyio.fail_after(40):
            r = await sb.exec("b() { b | b & }; b; sleep 30", timeout=3)
        assert r.timed_out or r.exit_code != 0
        assert "fork" in r.stderr.lower() or r.timed_out
        await _still_fine(sb)
        # The bomb is gone: the host has about as many processes as before (others may start a few).
        assert len(psutil.pids()) < host_before + 40


async def test_rm_rf_root_leaves_the_host_and_the_system_unchanged(backend, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "canary.txt").write_text("keep me")
    (tmp_path / "outside.txt").write_text("keep me too")
    async with sandbox(backend, workspace=str(ws), limits=LIMITS) as (_, sb):
        assert (await sb.exec("cat canary.txt")).stdout == "keep me"
        # rm walks every read-only file of the system mounts too (each refused). Once, in a full
        # run, this came back with no output (cause not found; a 15 s limit then): the limit is
        # generous now and a failure shows the whole result.
        r = await sb.exec("rm -rf --no-preserve-root / 2>/dev/null; ls -A /workspace | wc -l", timeout=60)
        assert r.stdout.strip() == "0" and not r.timed_out, r  # its own workspace is gone...
        assert (await sb.exec("test -x /bin/sh && python3 -c 'print(1)'")).stdout == "1\n"  # ...the system is not
        await _still_fine(sb)
    assert (ws / "canary.txt").read_text() == "keep me"
    assert (tmp_path / "outside.txt").read_text() == "keep me too"


async def test_writing_past_the_file_size_limit_fails(backend):
    async with sandbox(backend, limits=LIMITS) as (_, sb):
        r = await sb.exec("head -c 3000000 /dev/zero > big; echo rc=$?; wc -c < big")
        rc, size = r.stdout.split()
        assert rc != "rc=0"
        assert int(size) <= 1 << 20
        await _still_fine(sb)


async def test_ten_gigabytes_of_stdout_are_cut_without_using_memory(backend):
    async with sandbox(backend, limits=LIMITS) as (_, sb):
        rss_before = psutil.Process().memory_info().rss
        with anyio.fail_after(60):
            r = await sb.exec("head -c 10000000000 /dev/zero | tr '\\0' x")
        assert r.truncated and r.exit_code is None
        assert len(r.stdout) == LIMITS["output_bytes"] and set(r.stdout) == {"x"}
        assert psutil.Process().memory_info().rss - rss_before < 200 << 20
        await _still_fine(sb)


async def test_host_files_outside_the_workspace_are_invisible(backend, tmp_path):
    token = secrets.token_hex(16)
    secret = tmp_path / "secret.txt"
    secret.write_text(token)
    async with sandbox(backend, limits=LIMITS) as (_, sb):
        r = await sb.exec(
            f"cat {secret} /etc/shadow /root/.bash_history 2>&1; ls {tmp_path} 2>&1;"
            f" grep -rs {token} /etc /home /root /var /srv /opt /mnt /workspace /tmp 2>/dev/null; true",
            timeout=15,
        )
        assert token not in r.stdout + r.stderr
        assert (await sb.exec(f"test -e {os.getcwd()}/pyproject.toml; echo $?")).stdout == "1\n"
        await _still_fine(sb)


async def test_no_network_not_even_the_hosts_loopback(backend):
    async def serve(stream):
        await stream.send(b"host-only\n")
        await stream.aclose()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with anyio.create_task_group() as tg, sandbox(backend, limits=LIMITS) as (_, sb):
        tg.start_soon(listener.serve, serve)
        code = (
            "import socket\n"
            "print(sorted(n for _, n in socket.if_nameindex()))\n"
            "for addr in [('127.0.0.1', %d), ('10.1.2.3', 80), ('1.1.1.1', 53)]:\n"
            "    try:\n"
            "        print(socket.create_connection(addr, timeout=2).recv(64))\n"
            "    except OSError as e:\n"
            "        print('blocked', type(e).__name__)\n" % port
        )
        await sb.write_file("net.py", code)
        r = await sb.exec("python3 net.py", timeout=20)
        tg.cancel_scope.cancel()
    assert r.exit_code == 0, r
    assert r.stdout.splitlines()[0] == "['lo']"
    assert r.stdout.count("blocked") == 3 and "host-only" not in r.stdout


async def test_a_command_ignoring_sigterm_is_killed_at_its_timeout(backend):
    async with sandbox(backend, limits=LIMITS) as (_, sb):
        with anyio.fail_after(20):
            r = await sb.exec("trap '' TERM INT HUP; sleep 1000 & while :; do sleep 1; done", timeout=1)
        assert r.timed_out and r.exit_code is None
        await _still_fine(sb)


async def test_a_command_that_never_ends_is_killed_at_its_timeout(backend):
    async with sandbox(backend, limits={**LIMITS, "wall_seconds": 1.0}) as (_, sb):
        with anyio.fail_after(20):
            r = await sb.exec("while :; do :; done")  # no timeout given: the spec's wall_seconds
        assert r.timed_out and r.exit_code is None and r.duration_s < 10
        await _still_fine(sb)
