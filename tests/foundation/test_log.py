"""Quiet by default: library logs and warnings go to files under the run's logs/ directory, the
terminal keeps PSRL's own lines; ``debug`` brings everything back. Run in a fresh interpreter:
logging is process-wide."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

SCRIPT = """
import logging, os, sys, warnings
from psrl.log import configure_logging, get_logger
configure_logging(sys.argv[1], "console", log_dir=sys.argv[2])
logging.getLogger("vllm.engine").info("vllm-info-line")
logging.getLogger("ray.worker").warning("ray-warning-line")
logging.getLogger("megatron.core").error("megatron-error-line")
logging.getLogger("psrl.gateway").warning("psrl-warning-line")
warnings.warn("a-deprecation-line", DeprecationWarning, stacklevel=1)
warnings.warn("a-user-warning-line", UserWarning, stacklevel=1)
get_logger("psrl.pipeline").info("psrl-progress-line")
print(os.environ["VLLM_LOGGING_CONFIG_PATH"] if "VLLM_LOGGING_CONFIG_PATH" in os.environ else "-", os.environ["PSRL_LOG_LEVEL"])
"""


def _run(level: str, log_dir: Path) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[2]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-W", "always", "-c", SCRIPT, level, str(log_dir)], capture_output=True, text=True, env=env, timeout=60)


def test_quiet_terminal_keeps_psrl_lines_and_files_keep_the_rest(tmp_path):
    out = _run("info", tmp_path / "logs")
    assert out.returncode == 0, out.stderr
    for line in ("psrl-warning-line", "psrl-progress-line", "megatron-error-line"):
        assert line in out.stderr
    for line in ("vllm-info-line", "ray-warning-line", "a-deprecation-line", "a-user-warning-line"):
        assert line not in out.stderr
    python_log = (tmp_path / "logs" / "python.log").read_text()
    for line in ("vllm-info-line", "ray-warning-line", "a-user-warning-line", "megatron-error-line"):
        assert line in python_log  # vllm's own file config applies once vLLM is imported; here it is not
    config, level = out.stdout.split()
    assert Path(config) == tmp_path / "logs" / "vllm_logging.json" and level == "WARNING"
    assert '"vllm.log"' not in Path(config).read_text() and str(tmp_path / "logs" / "vllm.log") in Path(config).read_text()


def test_debug_brings_everything_back(tmp_path):
    out = _run("debug", tmp_path / "logs")
    assert out.returncode == 0, out.stderr
    for line in ("vllm-info-line", "ray-warning-line", "psrl-warning-line", "a-user-warning-line", "psrl-progress-line"):
        assert line in out.stderr
    assert out.stdout.split() == ["-", "DEBUG"] and not (tmp_path / "logs").exists()


SWAPPED = """
import io, logging, sys
from psrl.log import configure_logging, get_logger
real, sys.stderr = sys.stderr, io.StringIO()  # as a test runner captures a test's output
configure_logging(sys.argv[1], "console", log_dir=sys.argv[2])
get_logger("psrl.x").warning("into-the-captured-stream")
captured = sys.stderr.getvalue()
sys.stderr.close()
sys.stderr = real  # the runner closes its capture and restores stderr
get_logger("psrl.x").warning("after-the-swap")
logging.getLogger("psrl.y").warning("stdlib-after-the-swap")
print("captured" if "into-the-captured-stream" in captured else "lost")
"""


@pytest.mark.parametrize("level", ["info", "debug"])
def test_logging_follows_stderr_when_a_caller_swaps_and_closes_it(tmp_path, level):
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", SWAPPED, level, str(tmp_path / "logs")], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "captured"
    assert "after-the-swap" in out.stderr and "stdlib-after-the-swap" in out.stderr
    assert "closed file" not in out.stderr
