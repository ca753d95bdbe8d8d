"""Shared fixtures. Async tests use anyio's pytest plugin; backend-agnostic ones run on both
asyncio and trio (the ``anyio_backend`` fixture below); tests that need asyncio (vLLM, aiodocker)
override it in their module with ``pytestmark``/a local fixture."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param
