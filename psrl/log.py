"""structlog, configured once by the CLI (console or JSON lines). Library code only logs.

Quiet by default: with a ``log_dir`` (the CLI passes ``<logging.output_dir>/logs``) and any level
but ``debug``, the terminal shows PSRL's own log lines and progress, warnings and errors of PSRL,
and errors of anything else. Everything else -- vLLM (in every process it spawns), Ray,
Megatron, transformers, Python warnings -- goes to files in ``log_dir``: ``vllm.log`` and
``python.log``. ``logging.level=debug`` (``-v``) sends it all to the terminal, as before.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_FILE_FORMAT = "%(asctime)s %(levelname)s pid=%(process)d [%(name)s] %(message)s"


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time of each write, not the one present when
    logging was configured: a caller that swaps stderr (a test runner capturing output, an
    embedding application) and later closes its stream must not break every later log line."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


_STDERR = _CurrentStderr()


def configure_logging(level: str = "info", fmt: str = "console", log_dir: str | os.PathLike | None = None) -> None:
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=_STDERR),
        cache_logger_on_first_use=False,
    )
    # Read by processes PSRL starts (transfer-queue services, Ray actors, vLLM's engine args).
    os.environ.setdefault("PSRL_LOG_LEVEL", "DEBUG" if level == "debug" else "WARNING")
    if log_dir is None or level == "debug":
        logging.basicConfig(level=max(_LEVELS[level], logging.WARNING) if level != "debug" else logging.DEBUG, stream=_STDERR)
        return
    _quiet(Path(log_dir))


class _OwnOrSevere(logging.Filter):
    """The terminal's filter: PSRL's warnings, anyone's errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or (record.name.startswith("psrl") and record.levelno >= logging.WARNING)


def _quiet(log_dir: Path) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    # vLLM configures its loggers from this file when imported -- in this process and in the
    # engine-core processes it spawns, which inherit the environment.
    vllm_config = log_dir / "vllm_logging.json"
    vllm_config.write_text(json.dumps({
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": _FILE_FORMAT}},
        "handlers": {
            "file": {"class": "logging.FileHandler", "filename": str(log_dir / "vllm.log"), "formatter": "plain", "level": "INFO"},
            "terminal": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "plain", "level": "ERROR"},
        },
        "loggers": {"vllm": {"handlers": ["file", "terminal"], "level": "INFO", "propagate": False}},
    }))  # fmt: skip
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(vllm_config)
    # Child processes (vLLM's engine core, Ray workers) write to the terminal directly: these
    # quiet what they would print there -- library warnings, torch's C++ and Python warnings.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TORCH_LOGS", "-all")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning,ignore::UserWarning")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")

    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.setLevel(logging.INFO)
    to_file = logging.FileHandler(log_dir / "python.log")
    to_file.setFormatter(logging.Formatter(_FILE_FORMAT))
    to_terminal = logging.StreamHandler(_STDERR)
    to_terminal.addFilter(_OwnOrSevere())
    root.addHandler(to_file)
    root.addHandler(to_terminal)
    logging.captureWarnings(True)  # Python warnings (deprecations from libraries) to the file too
    for name in ("ray", "megatron", "torch", "transformers", "uvicorn"):
        lib = logging.getLogger(name)
        lib.handlers.clear()  # a library's own console handler would bypass the filter
        lib.propagate = True


def get_logger(name: str | None = None):
    return structlog.get_logger(name)
