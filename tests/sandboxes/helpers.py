"""Shared by the sandbox tests: backend parameters, the Docker engine check, a sandbox helper."""

from __future__ import annotations

import json
import os
import socket
from contextlib import asynccontextmanager
from functools import cache

import pytest

from psrl.config.sandbox import SandboxLimits, SandboxSpec
from psrl.sandboxes import make_backend

BACKENDS = ["bubblewrap", pytest.param("docker", marks=pytest.mark.docker)]
IMAGE = "psrl-sandbox:latest"


def _get(sock_path: str, path: str) -> tuple[int, bytes]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(3)
        s.connect(sock_path)
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: docker\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@cache
def docker_problem() -> str | None:
    """Why docker tests cannot run here, or None when an engine with our image answers."""
    host = os.environ.get("DOCKER_HOST", "")
    if not host:
        return 'DOCKER_HOST is not set; start an engine with: eval "$(.ci/docker.sh up)"'
    if not host.startswith("unix://"):
        return f"only unix:// DOCKER_HOST is probed by these tests, got {host}"
    try:
        status, body = _get(host[len("unix://"):], "/_ping")
        if status != 200:
            return f"the Docker engine at {host} answered /_ping with {status}"
        status, body = _get(host[len("unix://"):], f"/images/{IMAGE}/json")
    except OSError as e:
        return f"no Docker engine answers at {host}: {e}"
    if status != 200:
        return f"image {IMAGE} is missing at {host} (.ci/docker.sh up builds it): {json.loads(body or b'{}')}"
    return None


def require(backend: str) -> None:
    if backend == "docker" and (why := docker_problem()):
        pytest.skip(why)


def spec_for(backend: str, **kw) -> SandboxSpec:
    limits = kw.pop("limits", {})
    return SandboxSpec(backend=backend, limits=SandboxLimits(**{"wall_seconds": 20.0, **limits}), **kw)


@asynccontextmanager
async def sandbox(backend: str, **kw):
    """(backend object, one sandbox) of a spec; both closed afterwards."""
    require(backend)
    b = make_backend(spec_for(backend, **kw))
    try:
        sb = await b.create()
        try:
            yield b, sb
        finally:
            await sb.aclose()
    finally:
        await b.aclose()
