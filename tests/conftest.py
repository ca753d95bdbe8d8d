"""Shared fixtures. Async tests use anyio's pytest plugin; backend-agnostic ones run on both
asyncio and trio (the ``anyio_backend`` fixture below); tests that need asyncio (vLLM, aiodocker)
override it in their module with ``pytestmark``/a local fixture."""

from __future__ import annotations

import os

import pytest

pytest_plugins = ["tests.vllm_fixtures"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--run-slow") or "slow" in (config.getoption("-m") or "")
    skip_slow = pytest.mark.skip(reason="slow: pass --run-slow to run it")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    has_cuda = None
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if "gpu" in item.keywords:
            if has_cuda is None:
                try:
                    import torch

                    has_cuda = torch.cuda.is_available()
                except ImportError:
                    has_cuda = False
            if not has_cuda:
                item.add_marker(skip_gpu)


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under ``CI=true`` a docker-marked test that skips (no engine answered, image missing)
    fails instead: CI starts an engine for these tests, so a skip there means it broke, and a
    silent skip would hide that. ``-m "not docker"`` still deselects them without failing."""
    outcome = yield
    report = outcome.get_result()
    slow_skip = "slow" in item.keywords and not item.config.getoption("--run-slow")  # the tier, not Docker
    if report.skipped and "docker" in item.keywords and _ci() and not slow_skip and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"CI=true: docker-marked test skipped, which CI does not allow: {reason}"
