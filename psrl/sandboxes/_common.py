"""Pieces both backends share: bounded output capture, path and env checks."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping

WORKSPACE = "/workspace"
# What a command sees besides the caller's env. HOME is /tmp so dotfiles stay out of the workspace.
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "USER": "sandbox",
}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class CappedBuffer:
    """Keeps the first ``cap`` bytes of a stream; memory stays bounded whatever arrives."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._parts: list[bytes] = []
        self._size = 0
        self.overflowed = False

    def feed(self, data: bytes) -> bool:
        """Add a chunk; True once more than ``cap`` bytes have arrived in total."""
        room = self.cap - self._size
        if len(data) > room:
            self.overflowed = True
            data = data[: max(room, 0)]
        if data:
            self._parts.append(data)
            self._size += len(data)
        return self.overflowed

    def getvalue(self) -> bytes:
        return b"".join(self._parts)

    def text(self) -> str:
        return self.getvalue().decode("utf-8", errors="replace")


def sandbox_path(path: str) -> str:
    """An absolute, normalised path inside the sandbox; relative paths are under /workspace."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ValueError(f"sandbox path must be a non-empty string without NUL bytes, got {path!r}")
    return posixpath.normpath(posixpath.join(WORKSPACE, path))


def command_env(env: Mapping[str, str] | None) -> dict[str, str]:
    out = dict(BASE_ENV)
    for k, v in (env or {}).items():
        if not isinstance(k, str) or not _ENV_NAME.match(k):
            raise ValueError(f"environment variable name {k!r} is not a valid shell name")
        if not isinstance(v, str) or "\0" in v:
            raise ValueError(f"environment variable {k} must be a string without NUL bytes, got {v!r}")
        out[k] = v
    return out


def check_command(cmd: str) -> None:
    if not isinstance(cmd, str) or "\0" in cmd:
        raise ValueError(f"command must be a string without NUL bytes, got {cmd!r:.200}")


def check_timeout(timeout: float | None, default: float) -> float:
    if timeout is None:
        return default
    if not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


# The in-sandbox wrapper: cd (a missing dir is the command's error, reported as its exit status),
# then run the command in the same shell (one exec fewer than ``sh -c``). $1 = cwd, $2 = command.
EXEC_WRAPPER = 'cd -- "$1" || exit; eval "shift 2; $2"'
# File operations, run as sandbox commands so they obey the same mounts, uid and limits.
READ_SCRIPT = '[ -e "$1" ] || exit 3; [ -d "$1" ] && exit 4; exec cat -- "$1"'
WRITE_SCRIPT = 'mkdir -p -- "$(dirname -- "$1")" && exec cat > "$1"'
UNTAR_SCRIPT = 'mkdir -p -- "$1" && exec tar -x --no-same-owner -C "$1" -f -'
READ_MISSING, READ_IS_DIR = 3, 4
