"""``check_sandbox``: the conformance suite every Sandbox implementation must pass."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Awaitable, Callable

import anyio

from psrl.sandboxes.base import ExecResult, Sandbox, SandboxError

from .conformance_env import ConformanceError

SandboxFactory = Callable[[], Awaitable[Sandbox]]
# Counts live processes whose command line holds a marker; the [m] keeps grep from counting itself.
_COUNT = "for d in /proc/[0-9]*; do tr '\\0' ' ' < $d/cmdline 2>/dev/null; echo; done | grep -c '{pat}'"


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise ConformanceError(what)


def _ok(r: ExecResult, what: str) -> None:
    _expect(r.exit_code == 0, f"{what}: expected exit 0, got {r}")


async def _raises(exc: type[BaseException] | tuple, what: str, fn: Callable[[], Awaitable[object]]) -> None:
    try:
        await fn()
    except exc:
        return
    except Exception as e:  # noqa: BLE001 - report what came instead
        raise ConformanceError(f"{what}: expected {exc}, got {type(e).__name__}: {e}") from e
    raise ConformanceError(f"{what}: expected {exc}, nothing was raised")


async def _count(sb: Sandbox, marker: str) -> int:
    pat = marker[:-1] + f"[{marker[-1]}]"
    r = await sb.exec(_COUNT.format(pat=pat))
    return int(r.stdout.strip() or "0")


async def _basics(sb: Sandbox) -> None:
    _expect(isinstance(sb, Sandbox), f"{type(sb).__name__} does not implement the Sandbox protocol")
    r = await sb.exec("echo out; echo err >&2; exit 3")
    _expect((r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n"), f"exit code / stdout / stderr wrong: {r}")
    _expect(not r.timed_out and not r.truncated and r.duration_s >= 0, f"flags wrong on a plain command: {r}")
    r = await sb.exec("pwd; echo $FOO", env={"FOO": "bar baz"})
    _expect(r.stdout == "/workspace\nbar baz\n", f"default cwd must be /workspace and env must pass: {r}")
    _ok(await sb.exec("mkdir -p sub/dir"), "mkdir")
    r = await sb.exec("pwd", cwd="sub/dir")
    _expect(r.stdout == "/workspace/sub/dir\n", f"a relative cwd is under /workspace: {r}")
    r = await sb.exec("true", cwd="/no/such/dir")
    _expect(r.exit_code not in (0, None) and not r.timed_out, f"a missing cwd is a failed command, got {r}")
    r = await sb.exec("printf 'caf\\303\\251 \\377'")
    _expect(r.stdout.startswith("café "), f"stdout is decoded as UTF-8 (invalid bytes replaced): {r}")


async def _files(sb: Sandbox, host_dir: str) -> None:
    _ok(await sb.exec("echo persisted > p.txt && echo t > /tmp/t.txt"), "write by exec")
    r = await sb.exec("cat p.txt /tmp/t.txt")
    _expect(r.stdout == "persisted\nt\n", f"files in /workspace and /tmp persist between commands: {r}")
    _expect(await sb.read_file("p.txt") == b"persisted\n", "read_file sees what exec wrote")
    blob = bytes(range(256)) * 64
    await sb.write_file("a/b/blob.bin", blob)
    _expect(await sb.read_file("/workspace/a/b/blob.bin") == blob, "binary write_file/read_file round trip")
    _ok(await sb.exec("cmp -s a/b/blob.bin /workspace/a/b/blob.bin && test $(wc -c < a/b/blob.bin) = 16384"), "exec sees write_file")
    await sb.write_file("/tmp/note.txt", "héllo")
    _expect(await sb.read_file("/tmp/note.txt") == "héllo".encode(), "str data is written as UTF-8")
    await _raises(FileNotFoundError, "read_file of a missing file", lambda: sb.read_file("missing.txt"))
    await _raises(IsADirectoryError, "read_file of a directory", lambda: sb.read_file("a"))
    await _raises((SandboxError, PermissionError, OSError), "write_file outside the writable dirs",
                  lambda: sb.write_file("/usr/psrl-conformance", b"x"))
    os.makedirs(os.path.join(host_dir, "pkg", "inner"))
    with open(os.path.join(host_dir, "pkg", "inner", "m.py"), "w") as f:
        f.write("X = 1\n")
    with open(os.path.join(host_dir, "pkg", "run.sh"), "w") as f:
        f.write("#!/bin/sh\necho ran\n")
    os.chmod(os.path.join(host_dir, "pkg", "run.sh"), 0o755)
    await sb.upload_dir(os.path.join(host_dir, "pkg"), "up")
    r = await sb.exec("cat up/inner/m.py && ./up/run.sh")
    _expect(r.stdout == "X = 1\nran\n", f"upload_dir copies the tree, modes included: {r}")
    await _raises((NotADirectoryError, FileNotFoundError), "upload_dir of a missing host dir",
                  lambda: sb.upload_dir(os.path.join(host_dir, "nope"), "x"))


async def _limits(sb: Sandbox) -> None:
    with anyio.fail_after(20):
        r = await sb.exec("sleep 60", timeout=0.5)
    _expect(r.timed_out and r.exit_code is None, f"a command past its timeout is killed and says so: {r}")
    with anyio.fail_after(20):
        r = await sb.exec("trap '' TERM INT; while :; do sleep 1; done", timeout=0.5)
    _expect(r.timed_out, f"a command ignoring SIGTERM is still killed: {r}")
    r = await sb.exec("(sleep 3131 &); sleep 3132 & echo started")
    _expect(r.stdout == "started\n", f"background start: {r}")
    _expect(await _count(sb, "sleep 3131") + await _count(sb, "sleep 3132") == 0,
            "processes a command left in the background must not outlive its exec")
    r = await sb.exec("head -c 100000000 /dev/zero | tr '\\0' a")
    _expect(r.truncated and 0 < len(r.stdout) <= 100_000_000, f"output past the limit is cut: {r.exit_code}")


async def _cancel_and_close(factory: SandboxFactory) -> None:
    sb = await factory()
    try:
        with anyio.move_on_after(0.5):
            await sb.exec("sleep 3133")
        _expect(await _count(sb, "sleep 3133") == 0, "a cancelled exec leaves no process behind")
        _ok(await sb.exec("true"), "the sandbox works after a cancelled exec")
        await sb.write_file("gone.txt", "x")
        _ok(await sb.exec("echo x > /tmp/gone.txt"), "write")
        await sb.reset()
        r = await sb.exec("ls -A /tmp; test -e gone.txt && echo still-there")
        _expect("gone.txt" not in r.stdout and "still-there" not in r.stdout, f"reset() empties /tmp and the workspace: {r}")
        await _raises(ValueError, "a command with a NUL byte", lambda: sb.exec("echo \0"))
        await _raises(ValueError, "an env name that is not a shell name", lambda: sb.exec("true", env={"A-B": "1"}))
        await _raises(ValueError, "a negative timeout", lambda: sb.exec("true", timeout=-1))
    finally:
        await sb.aclose()
    await sb.aclose()  # idempotent
    await _raises(SandboxError, "exec after aclose", lambda: sb.exec("true"))

    sb = await factory()
    outcome: list[BaseException | ExecResult] = []

    async def run() -> None:
        try:
            outcome.append(await sb.exec("sleep 3134", timeout=60))
        except Exception as e:  # noqa: BLE001
            outcome.append(e)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await anyio.sleep(0.5)
            await sb.aclose()
    _expect(len(outcome) == 1 and isinstance(outcome[0], SandboxError),
            f"aclose() during an exec ends that exec with SandboxError, got {outcome}")


async def check_sandbox(factory: SandboxFactory, *, timeout_s: float = 180.0) -> None:
    """Run the conformance checks on sandboxes from ``factory``; raise ``ConformanceError``.

    - exec: exit code, stdout/stderr apart, env, cwd (default /workspace, relative, missing);
    - files persist between commands; write/read_file (binary, nested, missing, directory,
      read-only location), upload_dir with modes;
    - a timeout kills even a command that ignores SIGTERM; background processes do not outlive
      their exec; output past the limit is cut and flagged;
    - two sandboxes share nothing; reset() empties them;
    - bad arguments raise ValueError; a cancelled exec leaves nothing running; aclose() is
      idempotent, ends a running exec with SandboxError, and exec after it raises SandboxError.
    """
    with anyio.fail_after(timeout_s), tempfile.TemporaryDirectory(prefix="psrl-check-sandbox-") as host_dir:
        a, b = await factory(), await factory()
        try:
            await _basics(a)
            await _files(a, host_dir)
            r = await b.exec("test -e p.txt || test -e /tmp/t.txt; echo $?")
            _expect(r.stdout == "1\n", f"two sandboxes must not share files: {r}")
            await _limits(a)
        finally:
            await a.aclose()
            await b.aclose()
        await _cancel_and_close(factory)
