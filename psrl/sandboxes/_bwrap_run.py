"""Run one bwrap invocation: bounded output, a wall-clock limit, and a kill that takes the whole
process tree with it.

bwrap reports the host pid of the sandbox's pid 1 on ``--json-status-fd``. Killing that pid ends
the PID namespace, and the kernel kills every process in it before the pid is reaped: nothing
started inside can survive, however it forks, ignores signals or changes its session. The outer
bwrap then exits on its own; ``--die-with-parent`` covers the case where this process dies first.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import anyio
from anyio.abc import ByteReceiveStream, Process

from ._common import CappedBuffer
from ._state import kill_and_wait, kill_pid, pid_gone, processes_of

_CHILD_PID = re.compile(rb'"child-pid"\s*:\s*(\d+)')
_EXIT_CODE = re.compile(rb'"exit-code"\s*:\s*(-?\d+)')
STATUS_FD_PLACEHOLDER = "{status_fd}"


@dataclass(frozen=True)
class RunOutcome:
    stdout: bytes
    stderr: bytes
    exit_code: int | None
    timed_out: bool
    truncated: bool
    started: bool  # the sandbox came up (bwrap reported its child); False: bwrap itself failed
    duration_s: float


class _Status:
    """The non-blocking read end of bwrap's --json-status-fd."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.data = b""
        os.set_blocking(fd, False)

    def poll(self) -> None:
        while self.fd >= 0:
            try:
                chunk = os.read(self.fd, 4096)
            except BlockingIOError:
                return
            if not chunk:
                return
            self.data += chunk

    def child_pid(self) -> int | None:
        self.poll()
        m = _CHILD_PID.search(self.data)
        return int(m.group(1)) if m else None

    def exit_code(self) -> int | None:
        self.poll()
        m = _EXIT_CODE.search(self.data)
        return int(m.group(1)) if m else None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


async def _pump(stream: ByteReceiveStream, buf: CappedBuffer, on_overflow: Callable[[], None]) -> None:
    async for chunk in stream:
        if buf.feed(chunk):
            on_overflow()
            return


def _feed_stdin(fd: int, feed: Callable[[BinaryIO], None]) -> None:
    with open(fd, "wb", buffering=1 << 16) as f, contextlib.suppress(BrokenPipeError):
        feed(f)


async def _kill_tree(proc: Process, status: _Status, marks: tuple[bytes, ...]) -> None:
    child = status.child_pid()
    if child is None:
        # Still setting up. Killing bwrap now can strand a child that has not yet armed
        # --die-with-parent, so give setup (milliseconds) the chance to report the child first.
        with anyio.move_on_after(2.0):
            while (child := status.child_pid()) is None and proc.returncode is None:
                await anyio.sleep(0.001)
    if child is not None:
        kill_pid(child)
    else:
        proc.kill()
    with anyio.move_on_after(2.0):
        await proc.wait()
    if proc.returncode is None:
        proc.kill()
        await proc.wait()
    if child is not None:
        # The namespace is gone once its pid 1 is; that takes a moment after the signal.
        deadline = time.monotonic() + 5.0
        while not pid_gone(child) and time.monotonic() < deadline:
            await anyio.sleep(0.001)
    if marks:
        # Last resort for a bwrap stranded mid-setup: its argv names this sandbox's dir.
        await anyio.to_thread.run_sync(lambda: kill_and_wait(processes_of(path_marks=marks)))


async def run_bwrap(
    argv: Sequence[str],
    *,
    timeout: float,
    output_cap: int,
    feed: Callable[[BinaryIO], None] | None = None,
    marks: tuple[bytes, ...] = (),
) -> RunOutcome:
    """``argv`` contains ``STATUS_FD_PLACEHOLDER`` where bwrap's status fd number goes; ``marks``
    are strings only this sandbox's bwrap processes carry in their command line."""
    t0 = time.perf_counter()
    status_r, status_w = os.pipe()
    stdin_r = stdin_w = -1
    if feed is not None:
        stdin_r, stdin_w = os.pipe()
    argv = [str(status_w) if a == STATUS_FD_PLACEHOLDER else a for a in argv]
    status = _Status(status_r)
    try:
        # Shielded: a cancel that lands while the child is being spawned would lose its handle,
        # and with it the means to kill it. Spawning takes milliseconds.
        with anyio.CancelScope(shield=True):
            proc = await anyio.open_process(
                argv,
                stdin=stdin_r if feed is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w,),
                env={},
                start_new_session=True,
            )
    except BaseException:
        status.close()
        for fd in (stdin_r, stdin_w):
            if fd >= 0:
                os.close(fd)
        raise
    finally:
        os.close(status_w)
    if stdin_r >= 0:
        os.close(stdin_r)

    out, err = CappedBuffer(output_cap), CappedBuffer(output_cap)
    truncated = timed_out = False
    try:
        with anyio.move_on_after(timeout) as deadline:
            async with anyio.create_task_group() as tg:

                def overflow() -> None:
                    nonlocal truncated
                    truncated = True
                    tg.cancel_scope.cancel()

                assert proc.stdout is not None and proc.stderr is not None
                tg.start_soon(_pump, proc.stdout, out, overflow)
                tg.start_soon(_pump, proc.stderr, err, overflow)
                if feed is not None:
                    # The thread ends by itself once the process is gone (EPIPE), so a cancelled
                    # exec need not wait for it.
                    tg.start_soon(
                        lambda: anyio.to_thread.run_sync(_feed_stdin, stdin_w, feed, abandon_on_cancel=True)
                    )
                    stdin_w = -1  # the thread owns it now
            if not truncated:
                await proc.wait()
        timed_out = deadline.cancelled_caught and not truncated
    finally:
        with anyio.CancelScope(shield=True):
            try:
                if proc.returncode is None:
                    await _kill_tree(proc, status, marks)
                else:
                    status.poll()
            finally:
                if stdin_w >= 0:
                    os.close(stdin_w)
                await proc.aclose()
                started = status.child_pid() is not None
                exit_code = status.exit_code()
                status.close()

    killed = truncated or timed_out
    return RunOutcome(
        stdout=out.getvalue(),
        stderr=err.getvalue(),
        exit_code=None if killed else (exit_code if exit_code is not None else proc.returncode),
        timed_out=timed_out,
        truncated=truncated,
        started=started,
        duration_s=time.perf_counter() - t0,
    )
