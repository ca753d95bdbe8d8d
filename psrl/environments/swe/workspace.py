"""The agent's changes to a task repository, and grading them in a fresh sandbox.

``collect_diff`` reads, from the agent's sandbox, every file that differs from the task's
snapshot (by SHA-256), plus the files it deleted. ``grade`` builds a fresh sandbox's workspace
from the snapshot, those changes and then the hidden tests with their package files and the
runner's configuration (written last, from the task, so the agent cannot replace them), runs the
tests there with the isolated runner of ``runner.py`` and reads the per-test results from the
runner's private channel. ``guard.py`` flags diffs that patch the test machinery. The agent's
sandbox is only read, after the agent is done; the hidden tests and the grader never enter it.
Threat model and limits: docs/swe_grading.md.
"""

from __future__ import annotations

import difflib
import io
import json
import secrets
import shlex
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass, field

from psrl.sandboxes import Sandbox

from .guard import pristine_overlay, suspect_reasons
from .runner import OUTPUT_FILE, RUNNER, looks_like_result, read_results
from .task import SWETask, tar_bytes

_STATE = "/tmp/.psrl_swe"
MAX_DIFF_BYTES = 16 << 20

# Runs in the agent's sandbox after the episode: changed files into a tar, a JSON summary out.
_COLLECT = r"""
import hashlib, json, os, sys, tarfile
root, orig, out, cap = "/workspace", json.load(open(sys.argv[1])), sys.argv[2], int(sys.argv[3])
changed, seen, skipped, total = [], set(), [], 0
with tarfile.open(out, "w") as tar:
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("__pycache__", ".git"))
        for f in sorted(files):
            full = os.path.join(d, f)
            rel = os.path.relpath(full, root)
            if f.endswith(".pyc"):
                continue
            if os.path.islink(full) or not os.path.isfile(full):
                skipped.append(rel)
                continue
            seen.add(rel)
            with open(full, "rb") as fh:
                data = fh.read()
            if orig.get(rel) == hashlib.sha256(data).hexdigest():
                continue
            total += len(data)
            if total > cap:
                print(json.dumps({"error": "changed files exceed %d bytes" % cap}))
                sys.exit(3)
            changed.append(rel)
            tar.add(full, arcname=rel, recursive=False)
print(json.dumps({"changed": changed, "deleted": sorted(set(orig) - seen), "skipped": skipped}))
"""

class DiffError(RuntimeError):
    pass


@dataclass(frozen=True)
class WorkspaceDiff:
    changed: Mapping[str, bytes]  # path -> new content (new files included)
    deleted: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()  # symlinks and special files, not carried over

    @property
    def empty(self) -> bool:
        return not self.changed and not self.deleted

    def apply(self, repo: Mapping[str, bytes]) -> dict[str, bytes]:
        files = {p: d for p, d in repo.items() if p not in self.deleted}
        files.update(self.changed)
        return files

    def unified(self, repo: Mapping[str, bytes]) -> str:
        """A readable patch (for logs and metrics; grading uses the files themselves)."""
        parts = []
        for path in sorted(set(self.changed) | set(self.deleted)):
            old = repo.get(path, b"").decode(errors="replace").splitlines(keepends=True)
            new = self.changed.get(path, b"").decode(errors="replace").splitlines(keepends=True)
            a = f"a/{path}" if path in repo else "/dev/null"
            b = f"b/{path}" if path in self.changed else "/dev/null"
            parts.extend(difflib.unified_diff(old, new, a, b))
        return "".join(parts)


@dataclass(frozen=True)
class GradeResult:
    reward: float
    passed: int
    total: int
    results: dict[str, bool] = field(default_factory=dict)
    error: str | None = None  # why grading could not run fully (timeout, unreadable results)
    suspect: tuple[str, ...] = ()  # why the diff or the test run looks like gaming the grader


async def collect_diff(sandbox: Sandbox, task: SWETask, *, max_bytes: int = MAX_DIFF_BYTES) -> WorkspaceDiff:
    await sandbox.write_file(f"{_STATE}/orig.json", json.dumps(task.repo_hashes()))
    await sandbox.write_file(f"{_STATE}/collect.py", _COLLECT)
    r = await sandbox.exec(
        f"python3 {_STATE}/collect.py {_STATE}/orig.json {_STATE}/diff.tar {max_bytes}", cwd="/", timeout=60
    )
    try:
        summary = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise DiffError(f"could not read the workspace (exit {r.exit_code}): {(r.stderr or r.stdout)[-500:]}") from None
    if "error" in summary:
        raise DiffError(summary["error"])
    changed: dict[str, bytes] = {}
    if summary["changed"]:
        with tarfile.open(fileobj=io.BytesIO(await sandbox.read_file(f"{_STATE}/diff.tar"))) as tar:
            for member in tar.getmembers():
                if member.isfile():  # read into memory only: nothing is extracted on the host
                    changed[member.name] = tar.extractfile(member).read()  # type: ignore[union-attr]
    return WorkspaceDiff(changed, tuple(summary["deleted"]), tuple(summary["skipped"]))


async def upload_repo(sandbox: Sandbox, files: Mapping[str, bytes]) -> None:
    await sandbox.write_file(f"{_STATE}/tree.tar", tar_bytes(files))
    r = await sandbox.exec(f"tar -xf {_STATE}/tree.tar -C /workspace && rm -f {_STATE}/tree.tar", cwd="/", timeout=60)
    if r.exit_code != 0:
        raise RuntimeError(f"could not unpack the task repository in the sandbox: {(r.stderr or r.stdout)[-500:]}")


async def grade(sandbox: Sandbox, task: SWETask, diff: WorkspaceDiff, *, suspect_scores_zero: bool = True) -> GradeResult:
    """Run the hidden tests on snapshot + diff in ``sandbox`` (a fresh one).

    The hidden tests, their package files and the runner's configuration are written last, from
    the task (see ``guard.pristine_overlay``). A diff or a run that looks like gaming the grader
    (``guard.suspect_reasons``, a framework changed under the runner, result lines forged) is
    listed in ``suspect`` and, with ``suspect_scores_zero``, scores 0.
    """
    overlay, remove = pristine_overlay(task.repo, task.hidden_tests)
    files = {p: d for p, d in diff.apply(task.repo).items() if p not in remove}
    await upload_repo(sandbox, {**files, **overlay})
    suspect = suspect_reasons(diff.changed, diff.deleted, task.hidden_tests, task.repo)
    if task.grader == "command":
        r = await sandbox.exec(task.test_command or "", timeout=task.timeout_s)
        ok = r.exit_code == 0 and not (suspect and suspect_scores_zero)
        error = f"test command timed out after {task.timeout_s:g} s" if r.timed_out else None
        return GradeResult(float(ok), int(ok), 1, {"test_command": ok}, error, tuple(suspect))
    # A fresh random directory for the runner and its token; the runner deletes both on start.
    token, home = secrets.token_hex(16), f"/tmp/.r{secrets.token_hex(8)}"
    await sandbox.write_file(f"{home}/run.py", RUNNER)
    await sandbox.write_file(f"{home}/key", token)
    ids = " ".join(shlex.quote(t) for t in task.tests)
    r = await sandbox.exec(f"exec python3 -I {home}/run.py {home}/key {ids}", timeout=task.timeout_s)
    rep = read_results(r.stdout, token, task.tests)
    try:
        printed = (await sandbox.read_file(OUTPUT_FILE)).decode(errors="replace")
    except FileNotFoundError:
        printed = ""
    forged = rep.forged_lines + sum(looks_like_result(line, task.tests) for line in printed.splitlines())
    if forged:
        suspect.append(f"{forged} result-like lines did not come from the runner")
    if rep.tampered:
        suspect.append("the test framework changed while the tests ran: " + ", ".join(rep.tampered))
    passed = sum(rep.results.get(t, False) for t in task.tests)
    error = None
    if r.timed_out:
        error = f"grading timed out after {task.timeout_s:g} s; {len(rep.results)} of {len(task.tests)} tests ran"
    elif len(rep.results) < len(task.tests) and not rep.tampered:
        error = f"the grader reported {len(rep.results)} of {len(task.tests)} tests (exit {r.exit_code}): {printed[-500:]}"
    if suspect and suspect_scores_zero:
        passed = 0
    return GradeResult(passed / len(task.tests), passed, len(task.tests), rep.results, error, tuple(suspect))
