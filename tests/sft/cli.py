"""Running the real ``psrl`` command from the slow tests (a subprocess, the repository as cwd)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def psrl(*args: str, timeout: float) -> str:
    """``psrl ARGS``; its stdout. A non-zero exit fails the test with the ends of both streams."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "psrl.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert res.returncode == 0, f"psrl {' '.join(args)}\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    return res.stdout
