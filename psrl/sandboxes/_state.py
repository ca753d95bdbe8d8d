"""Host-side bookkeeping for bubblewrap sandboxes: one dir per live sandbox, proof of ownership,
and the sweep that removes what a dead run left.

Each sandbox owns ``<state>/sb-<slot>/`` and holds an exclusive ``flock`` on its ``lock`` file for
as long as it lives. The kernel drops the lock when the owner dies, however it dies, so a lock that
can be taken marks leftovers: nothing else (pid files, heartbeats) can go stale. A dir is built
under a temporary name and renamed into place with its lock already held, so the sweep never sees
a half-made one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import random
import shutil
import signal
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from .base import ReapReport, SandboxError

SLOTS = 1 << 20  # slot numbers; as root a slot is also the sandbox's uid (UID_BASE + slot)
UID_BASE = 1_500_000_000  # far above real users and the usual subuid ranges (100000-165535)
_NEW_PREFIX = ".new-"
_DIR_PREFIX = "sb-"


def default_state_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and os.access(runtime, os.W_OK):
        return Path(runtime) / "psrl-sandboxes"
    return Path(f"/tmp/psrl-sandboxes-{os.getuid()}")


def ensure_state_dir(path: str | os.PathLike | None) -> Path:
    """Create (0700) and check the state dir: a dir of ours, not a link another user planted."""
    p = Path(path) if path else default_state_dir()
    with contextlib.suppress(FileExistsError):
        p.mkdir(mode=0o700, parents=True)
    st = os.lstat(p)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise SandboxError(f"sandbox state dir {p} is not a directory owned by uid {os.getuid()}")
    return p


@dataclass
class SlotDir:
    """A live sandbox's host dir. ``close()`` releases the lock; ``remove()`` deletes the dir."""

    slot: int
    path: Path
    lock_fd: int

    @property
    def uid(self) -> int:
        return UID_BASE + self.slot

    def record(self, **fields: object) -> None:
        """Write facts the sweep needs if this process dies (e.g. the sandbox uid)."""
        data = json.dumps({"owner_pid": os.getpid(), **fields}).encode()
        os.ftruncate(self.lock_fd, 0)
        os.pwrite(self.lock_fd, data, 0)

    def close(self) -> None:
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1


def claim_slot(state: Path, attempts: int = 64) -> SlotDir:
    """A fresh ``sb-<slot>`` dir, locked by this process."""
    rng = random.SystemRandom()
    for _ in range(attempts):
        slot = rng.randrange(SLOTS)
        final = state / f"{_DIR_PREFIX}{slot}"
        if final.exists():
            continue
        tmp = state / f"{_NEW_PREFIX}{slot}-{os.getpid()}-{rng.getrandbits(32):08x}"
        tmp.mkdir(mode=0o700)
        fd = os.open(tmp / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new file: cannot be contended
        try:
            os.rename(tmp, final)  # fails if a racer took the slot (dirs are never empty)
        except OSError as e:
            os.close(fd)
            remove_tree(tmp)
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                continue
            raise
        return SlotDir(slot, final, fd)
    raise SandboxError(f"no free sandbox slot in {state} after {attempts} tries")


def remove_tree(path: Path) -> None:
    """``rm -rf`` that also gets through what a sandbox made unreadable (chmod 000 dirs, the
    overlay's mode-0 work dir when not running as root)."""

    def fix(func, p, exc_info):  # noqa: ANN001 - shutil's callback signature
        if isinstance(exc_info[1], FileNotFoundError):
            return
        parent = os.path.dirname(p)
        with contextlib.suppress(OSError):
            os.chmod(parent, 0o700)
        with contextlib.suppress(OSError):
            os.chmod(p, 0o700)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    if path.exists() or path.is_symlink():
        shutil.rmtree(path, onerror=fix)  # 3.11: no onexc yet


def empty_dir(path: Path, owner: int | None) -> None:
    """Make ``path`` an empty dir (owned by ``owner`` when given)."""
    remove_tree(path)
    path.mkdir(mode=0o755)
    if owner is not None:
        os.chown(path, owner, owner)


# ---------------------------------------------------------------------------------------------
# processes


def pid_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts: it runs nothing and holds nothing)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return data[data.rfind(b")") + 2 :][:1] in (b"Z", b"X")


def kill_pid(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def _proc_uid(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _proc_cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def processes_of(*, uids: set[int] = frozenset(), path_marks: tuple[bytes, ...] = ()) -> list[int]:
    """Pids running as one of ``uids`` or with one of ``path_marks`` in their command line."""
    me = os.getpid()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        if uids and _proc_uid(name) in uids:
            out.append(int(name))
        elif path_marks:
            cmd = _proc_cmdline(name)
            if any(m in cmd for m in path_marks):
                out.append(int(name))
    return out


def kill_and_wait(pids: list[int], timeout_s: float = 5.0) -> int:
    for pid in pids:
        kill_pid(pid)
    deadline = time.monotonic() + timeout_s
    while any(not pid_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.005)
    return len(pids)


# ---------------------------------------------------------------------------------------------
# the sweep


def reap_state_dir(state: Path, *, new_dir_grace_s: float = 60.0) -> ReapReport:
    """Kill the processes and remove the dirs of sandboxes whose owner is gone."""
    processes = dirs = 0
    try:
        names = os.listdir(state)
    except FileNotFoundError:
        return ReapReport()
    for name in names:
        path = state / name
        if name.startswith(_NEW_PREFIX):
            # A dir is only this name for microseconds while its creator runs; an old one is junk.
            with contextlib.suppress(FileNotFoundError):
                if time.time() - path.stat().st_mtime > new_dir_grace_s:
                    remove_tree(path)
                    dirs += 1
            continue
        if not name.startswith(_DIR_PREFIX):
            continue
        try:
            fd = os.open(path / "lock", os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # being removed by its owner right now
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner is alive
            if not path.exists():
                continue  # the owner removed it between our open and our lock
            try:
                info = json.loads(os.pread(fd, 4096, 0) or b"{}")
            except ValueError:
                info = {}
            uid = info.get("uid")
            pids = processes_of(
                uids={int(uid)} if isinstance(uid, int) else set(),
                path_marks=(str(path).encode() + b"/",),
            )
            processes += kill_and_wait(pids)
            remove_tree(path)
            dirs += 1
        finally:
            os.close(fd)
    return ReapReport(processes=processes, dirs=dirs)
