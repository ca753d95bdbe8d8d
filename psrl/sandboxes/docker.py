"""The docker backend: one container per sandbox, one ``docker exec`` per command, via aiodocker.

The container is hardened: no network (``NetworkMode=none``), read-only root, all capabilities
dropped, no-new-privileges, a pids cgroup limit, memory limit, rlimits. ``/workspace`` and
``/tmp`` are anonymous volumes removed with the container. Every container and volume carries
``psrl.sandbox=1`` and ``psrl.owner=<host>:<pid>:<start time>``, so a later run can reap exactly
those whose owner died.

PID 1 is a shell that ignores signals and reaps orphans. After each command the wrapper kills
every other process (``kill -9 -1`` spares PID 1 and the caller), which gives the bubblewrap
backend's rule: nothing a command starts outlives its ``exec``. A timeout or output overflow
does the same from a second exec.
"""

from __future__ import annotations

import io
import json
import os
import posixpath
import socket
import tarfile
import time
from collections.abc import Mapping
from typing import Any

import anyio

from psrl.config.sandbox import SandboxSpec

from . import _common as c
from ._aio import AsyncioCaller
from ._state import pid_gone
from .base import ExecResult, ReapReport, SandboxError

LABEL = "psrl.sandbox"
OWNER_LABEL = "psrl.owner"
_VOLUMES = ("/workspace", "/tmp")
_PID1 = 'trap "" TERM INT HUP; while :; do sleep 86400 & wait; done'
_EXEC_WRAPPER = 'cd -- "$1" || exit; (eval "shift 2; $2"); rc=$?; kill -9 -1 2>/dev/null; exit $rc'
_KILL_ALL = "kill -9 -1 2>/dev/null; exit 0"
_RESET = ("chmod -R u+rwX /workspace /tmp 2>/dev/null;"
          " find /workspace /tmp -mindepth 1 -maxdepth 1 -exec rm -rf {} + ; kill -9 -1 2>/dev/null; exit 0")
_READ_CAP_FLOOR = 64 << 20


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2 :].split()[19].decode()


def owner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{_start_time(os.getpid())}"


def owner_is_dead(owner: str | None) -> bool:
    """True only for an owner on this host that no longer runs; others' are left alone."""
    if not owner or owner.count(":") < 2:
        return False
    host, pid, started = owner.rsplit(":", 2)
    if host != socket.gethostname() or not pid.isdigit():
        return False
    return pid_gone(int(pid)) or _start_time(int(pid)) != started


def _tar_dir(src: str, arcname: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(src, arcname=arcname)
    return buf.getvalue()


def _tar_file(name: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _in_volume(path: str) -> tuple[str, str]:
    """(volume mount point, path relative to it) or SandboxError for paths outside them."""
    for mount in _VOLUMES:
        if path == mount or path.startswith(mount + "/"):
            return mount, posixpath.relpath(path, mount)
    raise SandboxError(f"{path} is on the read-only part of the sandbox; /workspace and /tmp are writable")


class DockerBackend:
    """Containers of one spec on one Docker engine; holds the aiodocker client."""

    def __init__(self, spec: SandboxSpec) -> None:
        if spec.root is not None:
            raise SandboxError("the docker backend takes spec.image, not spec.root")
        if spec.workspace is not None and not os.path.isdir(spec.workspace):
            raise SandboxError(f"sandbox workspace {spec.workspace!r} is not a directory")
        try:
            import aiodocker  # noqa: F401
        except ImportError:
            raise SandboxError("the docker backend needs aiodocker (pip install 'psrl[docker]')") from None
        self.spec = spec
        self.url = spec.docker_host or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
        self.owner = owner_id()
        self.labels = {LABEL: "1", OWNER_LABEL: self.owner}
        self.aio = AsyncioCaller()
        self._docker: Any = None
        self._workspace_tar: bytes | None = None

    # Everything below named _aio_* runs on asyncio (see _aio.py).

    def _client(self) -> Any:
        if self._docker is None:
            import aiodocker

            self._docker = aiodocker.Docker(url=self.url)
        return self._docker

    def _config(self) -> dict[str, Any]:
        lim, spec = self.spec.limits, self.spec
        host: dict[str, Any] = {
            "ReadonlyRootfs": True,
            "CapDrop": ["ALL"],
            "SecurityOpt": ["no-new-privileges"],
            "PidsLimit": lim.processes + 2,  # PID 1 and its sleep
            "Memory": lim.memory_mb << 20,
            "MemorySwap": lim.memory_mb << 20,
            "Ulimits": [
                {"Name": "nofile", "Soft": lim.open_files, "Hard": lim.open_files},
                {"Name": "fsize", "Soft": lim.file_size_mb << 20, "Hard": lim.file_size_mb << 20},
                {"Name": "cpu", "Soft": lim.cpu_seconds, "Hard": lim.cpu_seconds},
                {"Name": "core", "Soft": 0, "Hard": 0},
            ],
            "Mounts": [{"Type": "volume", "Target": t, "VolumeOptions": {"Labels": self.labels}} for t in _VOLUMES],
        }
        if not spec.network:
            host["NetworkMode"] = "none"
        return {
            "Image": spec.image, "Cmd": ["sh", "-c", _PID1], "Labels": self.labels,
            "WorkingDir": c.WORKSPACE, "User": "0:0", "NetworkDisabled": not spec.network,
            "Env": [f"{k}={v}" for k, v in c.BASE_ENV.items()], "HostConfig": host,
        }

    async def _aio_create(self) -> str:
        import aiodocker

        docker = self._client()
        try:
            # Shielded: cancelled mid-request, the engine may have made a container we never hear of.
            with anyio.CancelScope(shield=True):
                container = await docker.containers.create(self._config())
        except aiodocker.DockerError as e:
            raise SandboxError(f"docker could not create a {self.spec.image} container: {e}") from None
        try:
            await container.start()
            if self.spec.workspace:
                if self._workspace_tar is None:
                    self._workspace_tar = await anyio.to_thread.run_sync(_tar_dir, self.spec.workspace, ".")
                await container.put_archive(c.WORKSPACE, self._workspace_tar)
        except BaseException as e:
            with anyio.CancelScope(shield=True):
                await container.delete(force=True, v=True)
            if isinstance(e, aiodocker.DockerError):
                raise SandboxError(f"docker could not start a {self.spec.image} container: {e}") from None
            raise
        return container.id

    async def create(self) -> DockerSandbox:
        return DockerSandbox(self, await self.aio.call(self._aio_create))

    async def _aio_reap(self) -> ReapReport:
        docker = self._client()
        containers = volumes = 0
        listed = await docker.containers.list(all=True, filters=json.dumps({"label": [f"{LABEL}=1"]}))
        for cont in listed:
            if owner_is_dead(cont["Labels"].get(OWNER_LABEL)):
                await cont.delete(force=True, v=True)
                containers += 1
        listed = await docker.volumes.list(filters={"label": [f"{LABEL}=1"], "dangling": ["true"]})
        for vol in listed.get("Volumes") or []:
            if owner_is_dead((vol.get("Labels") or {}).get(OWNER_LABEL)):
                from aiodocker.volumes import DockerVolume

                await DockerVolume(docker, vol["Name"]).delete()
                volumes += 1
        return ReapReport(containers=containers, volumes=volumes)

    async def reap_stale(self) -> ReapReport:
        return await self.aio.call(self._aio_reap)

    async def _aio_close(self) -> None:
        if self._docker is not None:
            docker, self._docker = self._docker, None
            await docker.close()

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self.aio.call(self._aio_close)
            finally:
                await self.aio.aclose()


class DockerSandbox:
    def __init__(self, backend: DockerBackend, container_id: str) -> None:
        self._b = backend
        self.container_id = container_id
        self._lock = anyio.Lock()
        self._closed = False
        self._running: anyio.CancelScope | None = None

    def _container(self) -> Any:
        return self._b._client().containers.container(self.container_id)

    # -- asyncio side ----------------------------------------------------------------------------

    async def _aio_run(
        self, argv: list[str], env: Mapping[str, str] | None, timeout: float, cap: int,
    ) -> tuple[int | None, bytes, bytes, bool, bool, float]:
        t0 = time.perf_counter()
        ex = await self._container().exec(cmd=argv, stdout=True, stderr=True, environment=env, workdir="/")
        out, err = c.CappedBuffer(cap), c.CappedBuffer(cap)
        truncated = finished = False
        stream = ex.start(detach=False)
        # Shielded: once the start request is out the engine runs the command, and only a started
        # exec we know of can be stopped.
        with anyio.CancelScope(shield=True):
            await stream.__aenter__()
        try:
            with anyio.move_on_after(timeout):
                while (msg := await stream.read_out()) is not None:
                    if (out if msg.stream == 1 else err).feed(msg.data):
                        truncated = True
                        break
                else:
                    finished = True
        finally:
            with anyio.CancelScope(shield=True):
                await stream.close()
                if not finished:
                    await self._aio_stop(ex)
        exit_code = None
        if finished:
            with anyio.move_on_after(10):
                while (info := await ex.inspect())["Running"]:
                    await anyio.sleep(0.002)
                exit_code = info["ExitCode"]
        timed_out = not finished and not truncated
        return exit_code, out.getvalue(), err.getvalue(), timed_out, truncated, time.perf_counter() - t0

    async def _aio_stop(self, ex: Any) -> None:
        """Kill everything until ``ex`` has ended: the engine may still be starting its process
        when the first kill runs (it answers the start request before it starts it)."""
        with anyio.move_on_after(30):
            while True:
                await self._aio_kill_all()
                info = await ex.inspect()
                if not info["Running"] and info["ExitCode"] is not None:
                    return
                await anyio.sleep(0.01)

    async def _aio_kill_all(self) -> None:
        with anyio.move_on_after(10):
            ex = await self._container().exec(cmd=["sh", "-c", _KILL_ALL], stdout=True, stderr=True)
            async with ex.start(detach=False) as stream:
                while await stream.read_out() is not None:
                    pass

    async def _aio_put(self, mount: str, data: bytes) -> None:
        await self._container().put_archive(mount, data)

    async def _aio_reset(self) -> None:
        await self._aio_run(["sh", "-c", _RESET], None, 60.0, 65536)
        if self._b._workspace_tar is not None:
            await self._container().put_archive(c.WORKSPACE, self._b._workspace_tar)

    async def _aio_delete(self) -> None:
        import aiodocker

        try:
            await self._container().delete(force=True, v=True)
        except aiodocker.DockerError as e:
            if e.status != 404:
                raise

    # -- caller side -----------------------------------------------------------------------------

    async def _locked(self, fn: Any, *args: Any) -> Any:
        async with self._lock:
            if self._closed:
                raise SandboxError("sandbox is closed")
            with anyio.CancelScope() as scope:
                self._running = scope
                try:
                    result = await self._b.aio.call(fn, *args)
                finally:
                    self._running = None
            if scope.cancelled_caught:
                raise SandboxError("sandbox was closed while a command ran")
            return result

    async def _run(self, argv: list[str], env: Mapping[str, str] | None, timeout: float, cap: int) -> tuple:
        import aiodocker

        try:
            return await self._locked(self._aio_run, argv, env, timeout, cap)
        except aiodocker.DockerError as e:
            raise SandboxError(f"docker exec failed in container {self.container_id[:12]}: {e}") from None

    async def exec(
        self, cmd: str, *, timeout: float | None = None, env: Mapping[str, str] | None = None,
        cwd: str = c.WORKSPACE,
    ) -> ExecResult:
        c.check_command(cmd)
        lim = self._b.spec.limits
        code, out, err, timed_out, truncated, dur = await self._run(
            ["sh", "-c", _EXEC_WRAPPER, "psrl", c.sandbox_path(cwd), cmd], c.command_env(env),
            c.check_timeout(timeout, lim.wall_seconds), lim.output_bytes,
        )
        return ExecResult(
            exit_code=code, stdout=out.decode("utf-8", errors="replace"),
            stderr=err.decode("utf-8", errors="replace"), timed_out=timed_out, truncated=truncated,
            duration_s=dur,
        )

    async def write_file(self, path: str, data: bytes | str) -> None:
        p = c.sandbox_path(path)
        mount, rel = _in_volume(p)
        payload = data.encode() if isinstance(data, str) else bytes(data)
        if rel == ".":
            raise IsADirectoryError(f"is a directory in the sandbox: {p}")
        await self._put(mount, _tar_file(rel, payload), p)

    async def read_file(self, path: str) -> bytes:
        p = c.sandbox_path(path)
        cap = max(self._b.spec.limits.file_size_mb << 20, _READ_CAP_FLOOR)
        code, out, err, timed_out, truncated, _ = await self._run(
            ["sh", "-c", c.READ_SCRIPT, "psrl", p], None, max(self._b.spec.limits.wall_seconds, 60.0), cap
        )
        if truncated:
            raise SandboxError(f"{p} is larger than {cap} bytes, the most read_file returns")
        if code == c.READ_MISSING:
            raise FileNotFoundError(f"no such file in the sandbox: {p}")
        if code == c.READ_IS_DIR:
            raise IsADirectoryError(f"is a directory in the sandbox: {p}")
        if code != 0:
            msg = err.decode(errors="replace").strip() or ("timed out" if timed_out else f"exit status {code}")
            raise SandboxError(f"could not read {p}: {msg}")
        return out

    async def upload_dir(self, src: str, dst: str) -> None:
        if not os.path.isdir(src):
            raise NotADirectoryError(f"upload_dir source {src!r} is not a directory on the host")
        p = c.sandbox_path(dst)
        mount, rel = _in_volume(p)
        data = await anyio.to_thread.run_sync(_tar_dir, src, rel)
        await self._put(mount, data, p)

    async def _put(self, mount: str, data: bytes, path: str) -> None:
        import aiodocker

        try:
            await self._locked(self._aio_put, mount, data)
        except aiodocker.DockerError as e:
            raise SandboxError(f"could not write {path}: {e}") from None

    async def reset(self) -> None:
        await self._locked(self._aio_reset)

    async def _aio_top(self) -> list[str]:
        top = await self._container().top(ps_args="-o pid,args")
        idx = top["Titles"].index("COMMAND") if "COMMAND" in top["Titles"] else -1
        cmds = [row[idx] for row in top["Processes"]]
        return [cmd for cmd in cmds if cmd != "sleep 86400" and not cmd.startswith("sh -c trap")]

    async def leftover_processes(self) -> list[str]:
        """Command lines of processes besides PID 1 and its sleep; [] between commands."""
        return await self._locked(self._aio_top)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._running is not None:
            self._running.cancel()
        with anyio.CancelScope(shield=True):
            async with self._lock:
                await self._b.aio.call(self._aio_delete)

    async def __aenter__(self) -> DockerSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
