"""Under CI=true a docker-marked test that skips fails the run (tests/conftest.py); elsewhere it
skips as before. Checked by running pytest on a small test file in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE = '''
import pytest

@pytest.mark.docker
def test_needs_docker():
    pytest.skip("no Docker engine answers")

def test_plain_skip():
    pytest.skip("not docker: skipping is fine")
'''


def _run(tmp_path: Path, ci: str | None, *extra: str) -> subprocess.CompletedProcess:
    test = tmp_path / "test_probe.py"
    test.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-c", str(REPO / "pyproject.toml"),
           "--rootdir", str(tmp_path), "-p", "no:cacheprovider", str(test), *extra]
    return subprocess.run(cmd, cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=100)


@pytest.mark.timeout(120)
def test_docker_skip_fails_under_ci(tmp_path):
    out = _run(tmp_path, "true")
    assert out.returncode == 1, out.stdout
    assert "1 failed" in out.stdout and "1 skipped" in out.stdout, out.stdout
    assert "CI=true: docker-marked test skipped" in out.stdout and "no Docker engine answers" in out.stdout


@pytest.mark.timeout(120)
def test_docker_skip_is_a_skip_outside_ci(tmp_path):
    out = _run(tmp_path, None)
    assert out.returncode == 0, out.stdout
    assert "2 skipped" in out.stdout, out.stdout


@pytest.mark.timeout(120)
def test_deselecting_docker_under_ci_is_allowed(tmp_path):
    out = _run(tmp_path, "true", "-m", "not docker")
    assert out.returncode == 0, out.stdout
    assert "1 skipped" in out.stdout and "1 deselected" in out.stdout, out.stdout
