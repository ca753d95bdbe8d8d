"""The SWE task format: a repository snapshot, an issue, hidden tests and how to run them.

A task is one YAML file (the shipped ones live in ``psrl/environments/swe/tasks/``)::

    id: calc_divide_by_zero
    issue: |                      # what the agent is told
      ...
    repo:                         # the snapshot the agent starts from: path -> file text
      calc/core.py: |
        ...
    hidden_tests:                 # never shown to the agent; written over the agent's tree
      tests/test_hidden_core.py: |
        ...
    tests:                        # unittest ids that must pass; reward = fraction passed
      - tests.test_hidden_core.TestDivide.test_zero
    grader: unittest              # or "command": reward 1.0 when test_command exits 0
    test_command: null            # grader=command only, run in /workspace
    timeout_s: 60                 # for the whole grading run

or a directory holding ``task.yaml`` (the fields above but ``repo``/``hidden_tests``) with the
files under ``repo/`` and ``hidden/``, for tasks made from real repositories.

A dataset row names its task in ``extra_info.swe_task``: a shipped task id, a path to a task
file or directory, or the task itself as a mapping.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

TASKS_DIR = Path(__file__).with_name("tasks")
_FIELDS = {"id", "issue", "repo", "hidden_tests", "tests", "grader", "test_command", "timeout_s"}


class TaskFormatError(ValueError):
    pass


@dataclass(frozen=True)
class SWETask:
    id: str
    issue: str
    repo: Mapping[str, bytes]
    hidden_tests: Mapping[str, bytes]
    tests: tuple[str, ...] = ()
    grader: Literal["unittest", "command"] = "unittest"
    test_command: str | None = None
    timeout_s: float = 60.0
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        where = self.source or self.id or "task"
        if not self.id or not isinstance(self.id, str):
            raise TaskFormatError(f"{where}: 'id' must be a non-empty string")
        if not isinstance(self.issue, str) or not self.issue.strip():
            raise TaskFormatError(f"{where}: 'issue' must be non-empty text")
        if not self.repo:
            raise TaskFormatError(f"{where}: 'repo' holds no files")
        for name, files in (("repo", self.repo), ("hidden_tests", self.hidden_tests)):
            for path in files:
                _check_rel_path(path, f"{where}: {name}")
        if self.grader == "unittest":
            if not self.tests:
                raise TaskFormatError(f"{where}: grader 'unittest' needs the 'tests' ids to run")
        elif self.grader == "command":
            if not self.test_command:
                raise TaskFormatError(f"{where}: grader 'command' needs a 'test_command'")
        else:
            raise TaskFormatError(f"{where}: 'grader' must be 'unittest' or 'command', got {self.grader!r}")
        if not self.timeout_s > 0:
            raise TaskFormatError(f"{where}: 'timeout_s' must be positive, got {self.timeout_s!r}")

    # ---- loading ------------------------------------------------------------------------

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "") -> SWETask:
        where = source or str(data.get("id", "task"))
        unknown = set(data) - _FIELDS
        if unknown:
            raise TaskFormatError(f"{where}: unknown task fields {sorted(unknown)}; known: {sorted(_FIELDS)}")
        missing = {"id", "issue", "repo"} - set(data)
        if missing:
            raise TaskFormatError(f"{where}: missing task fields {sorted(missing)}")
        tests = data.get("tests") or ()
        if isinstance(tests, str) or not all(isinstance(t, str) for t in tests):
            raise TaskFormatError(f"{where}: 'tests' must be a list of unittest ids")
        return cls(
            id=str(data["id"]),
            issue=data["issue"],
            repo=_files(data["repo"], f"{where}: repo"),
            hidden_tests=_files(data.get("hidden_tests") or {}, f"{where}: hidden_tests"),
            tests=tuple(tests),
            grader=data.get("grader", "unittest"),
            test_command=data.get("test_command"),
            timeout_s=float(data.get("timeout_s", 60.0)),
            source=source,
        )

    @classmethod
    def from_path(cls, path: str | os.PathLike) -> SWETask:
        p = Path(path)
        if p.is_dir():
            meta_path = p / "task.yaml"
            if not meta_path.is_file():
                raise TaskFormatError(f"{p}: a task directory needs a task.yaml")
            meta = _load_yaml(meta_path)
            if "repo" in meta or "hidden_tests" in meta:
                raise TaskFormatError(f"{meta_path}: in a task directory, files live under repo/ and hidden/, not in task.yaml")
            meta = {**meta, "repo": _read_tree(p / "repo"), "hidden_tests": _read_tree(p / "hidden")}
            return cls.from_mapping(meta, str(p))
        if p.is_file():
            return cls.from_mapping(_load_yaml(p), str(p))
        raise TaskFormatError(f"no SWE task at {p}")

    # ---- for the sandbox side ---------------------------------------------------------------

    def repo_hashes(self) -> dict[str, str]:
        return {path: hashlib.sha256(data).hexdigest() for path, data in self.repo.items()}

    def to_row(self, *, agent_name: str = "mini_swe_agent") -> dict[str, Any]:
        """A dataset row for this task (a shipped task by id, any other by its source path)."""
        ref = self.id if _is_builtin(self) else (self.source or None)
        if ref is None:
            raise TaskFormatError(f"task {self.id!r} has no file to refer to; save it and load it with from_path")
        return {
            "prompt": self.issue,
            "data_source": "swe",
            "agent_name": agent_name,
            "env_class": "mini_swe_env",
            "data_class": "mini_swe_agent_data",
            "extra_info": {"swe_task": ref},
        }


def tar_bytes(files: Mapping[str, bytes]) -> bytes:
    """An uncompressed tar of ``files`` (relative paths), for one upload into a sandbox."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path, data in sorted(files.items()):
            info = tarfile.TarInfo(path)
            info.size = len(data)
            info.mode = 0o755 if data.startswith(b"#!") else 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def builtin_task_ids() -> list[str]:
    return sorted(p.stem for p in TASKS_DIR.glob("*.yaml"))


def load_builtin(task_id: str) -> SWETask:
    path = TASKS_DIR / f"{task_id}.yaml"
    if not path.is_file():
        raise TaskFormatError(f"unknown shipped SWE task {task_id!r}; known: {', '.join(builtin_task_ids())}")
    return SWETask.from_path(path)


def builtin_tasks() -> list[SWETask]:
    return [load_builtin(t) for t in builtin_task_ids()]


def resolve_task(ref: Any) -> SWETask:
    """A row's ``extra_info.swe_task``: a shipped id, a path, or the task as a mapping."""
    if isinstance(ref, SWETask):
        return ref
    if isinstance(ref, Mapping):
        return SWETask.from_mapping(ref)
    if isinstance(ref, str) and ref:
        if (TASKS_DIR / f"{ref}.yaml").is_file():
            return load_builtin(ref)
        if os.path.exists(ref):
            return SWETask.from_path(ref)
        raise TaskFormatError(f"swe_task {ref!r} is neither a shipped task ({', '.join(builtin_task_ids())}) nor a path")
    raise TaskFormatError(f"extra_info.swe_task must name a task (id or path) or hold one, got {ref!r:.80}")


def _is_builtin(task: SWETask) -> bool:
    return bool(task.source) and Path(task.source).resolve() == (TASKS_DIR / f"{task.id}.yaml").resolve()


def _load_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise TaskFormatError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise TaskFormatError(f"{path}: a task must be a mapping")
    return data


def _files(raw: Any, where: str) -> dict[str, bytes]:
    if not isinstance(raw, Mapping):
        raise TaskFormatError(f"{where} must map paths to file contents")
    out = {}
    for path, content in raw.items():
        if isinstance(content, bytes):
            out[str(path)] = content
        elif isinstance(content, str):
            out[str(path)] = content.encode()
        else:
            raise TaskFormatError(f"{where}: {path!r} must hold text, got {type(content).__name__}")
    return out


def _read_tree(root: Path) -> dict[str, bytes]:
    if not root.is_dir():
        return {}
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def _check_rel_path(path: str, where: str) -> None:
    parts = Path(path).parts
    if not path or path.startswith("/") or ".." in parts or "\0" in path:
        raise TaskFormatError(f"{where}: {path!r} must be a relative path inside the repository")
