"""Start an OpenEnv server (an installed environment's FastAPI ``app``) on loopback for one
episode, and stop it: ``uvicorn MODULE:app --host 127.0.0.1 --port FREE`` as a child process."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import AsyncIterator, Mapping

import anyio
import anyio.abc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _wait_listening(port: int, proc: anyio.abc.Process, timeout_s: float) -> None:
    with anyio.fail_after(timeout_s):
        while True:
            if proc.returncode is not None:
                raise RuntimeError(f"the OpenEnv server exited with code {proc.returncode} before listening")
            try:
                stream = await anyio.connect_tcp("127.0.0.1", port)
            except OSError:
                await anyio.sleep(0.1)
                continue
            await stream.aclose()
            return


@contextlib.asynccontextmanager
async def serve_app(app: str, *, app_dir: str | None = None, env: Mapping[str, str] | None = None, start_timeout_s: float = 60.0) -> AsyncIterator[str]:
    """Serve ``app`` ("package.module:app") until the block ends; yields its ``http://`` URL.
    The server is terminated (then killed) on exit, also on error or cancellation."""
    port = _free_port()
    cmd = [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    if app_dir:
        cmd += ["--app-dir", app_dir]
    child_env = {**os.environ, **(env or {}), "ENABLE_WEB_INTERFACE": "false"}
    proc = await anyio.open_process(cmd, env=child_env, cwd=app_dir or None, stdout=None, stderr=None)
    try:
        await _wait_listening(port, proc, start_timeout_s)
        yield f"http://127.0.0.1:{port}"
    finally:
        with anyio.CancelScope(shield=True):
            if proc.returncode is None:
                proc.terminate()
                with anyio.move_on_after(5):
                    await proc.wait()
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            await proc.aclose()
