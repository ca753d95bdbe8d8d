"""Engine processes die with the process that started them, even when it is SIGKILLed.

vLLM's engine core runs in a child process (its workers in grandchildren) that notices neither
SIGKILL of its parent nor the kernel's OOM killer: before this, an OOM-killed ``psrl train`` left
its engines running, orphaned, holding gigabytes and a core each. ``Reaper(procs)`` starts a
small watcher process that blocks reading a pipe from this process; the kernel closes the pipe
however this process ends, and the watcher then kills whichever of ``procs`` (and their
descendants) still run. A normal shutdown stops the engine first, then ``close()`` closes the
pipe: the watcher finds nothing left and exits.
"""

from __future__ import annotations

import subprocess
import sys

import psutil

_WATCH = r"""
import signal, sys
import psutil
procs = []
for spec in sys.argv[1:]:
    pid, created = spec.split(":")
    try:
        p = psutil.Process(int(pid))
        if abs(p.create_time() - float(created)) < 1e-3:  # the same process, not a reused pid
            procs.append(p)
    except psutil.NoSuchProcess:  # gone already: nothing to watch
        pass
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C to the group: the parent shuts down first
sys.stdin.buffer.read()  # returns when the parent closes the pipe or dies
doomed = []
for p in procs:
    try:
        doomed += [*p.children(recursive=True), p]
    except psutil.NoSuchProcess:  # the engine's own shutdown got there first
        pass
for p in doomed:
    try:
        p.kill()
    except psutil.NoSuchProcess:
        pass
psutil.wait_procs(doomed, timeout=10)
"""


def engine_core_processes(llm: object) -> list[psutil.Process]:
    """The engine-core processes of a vLLM ``AsyncLLM`` (their workers are their children);
    empty when the engine core runs in this process or vLLM's layout is not the one known."""
    manager = getattr(getattr(getattr(llm, "engine_core", None), "resources", None), "engine_manager", None)
    out = []
    for proc in getattr(manager, "processes", None) or []:
        try:
            out.append(psutil.Process(proc.pid))
        except (psutil.Error, TypeError, ValueError):
            continue
    return out


class Reaper:
    """Kills ``procs`` and their descendants when this process ends without ``close()``-ing
    first (SIGKILL, OOM killer, a crash); ``close()`` after a clean shutdown kills what is left."""

    def __init__(self, procs: list[psutil.Process]) -> None:
        specs = []
        for p in procs:
            try:
                specs.append(f"{p.pid}:{p.create_time()!r}")
            except psutil.Error:
                continue
        self._proc: subprocess.Popen | None = None
        if specs:
            self._proc = subprocess.Popen(
                # stderr is this process's: anything but "already gone" shows up as a traceback.
                [sys.executable, "-c", _WATCH, *specs], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True,
            )

    def close(self, timeout: float = 15.0) -> None:
        """After the engine's own shutdown: the watcher kills what is left and exits."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
