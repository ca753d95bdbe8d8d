"""The hidden-test runner that runs inside the grading sandbox, and reading what it reports.

The runner is started as ``python3 -I RUNNER SECRET_FILE TEST_ID...`` (isolated: no PYTHON*
variables, no user site, neither the script's directory nor the working directory on
``sys.path``). Before any code of the workspace is imported it:

1. reads the per-grading secret (a random token) from ``SECRET_FILE``, then deletes that file,
   the directory holding it and the runner script itself, so neither the path nor the token is
   left on disk for the code under test to find;
2. keeps a private duplicate of its stdout (the channel the grader reads), then points fds 1 and 2
   at a capture file, so whatever the code under test prints, writes to ``/dev/stdout`` or to
   fd 1 never reaches the grader as a result;
3. snapshots the test framework it will rely on: the ``unittest`` modules and classes (every
   attribute and every function's code object), ``builtins`` and the modules already in
   ``sys.modules``.

After each test it checks the snapshot again. A result line is ``SECRET {json}``; lines without
the token are ignored by :func:`read_results`. When the framework was changed under it, the runner
reports ``tampered`` with what changed, and the grader scores the whole workspace 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

RUNNER = r'''
import builtins, io, json, os, sys, types, unittest
import unittest.case, unittest.loader, unittest.result, unittest.runner, unittest.suite, unittest.util

secret_file, test_ids = sys.argv[1], sys.argv[2:]
with open(secret_file) as fh:
    token = fh.read().strip()
for path in (secret_file, os.path.abspath(__file__)):
    try:
        os.unlink(path)
    except OSError:
        pass
for path in {os.path.dirname(secret_file), os.path.dirname(os.path.abspath(__file__))}:
    try:
        os.rmdir(path)
    except OSError:
        pass

channel = os.dup(1)  # the grader reads only this; fds 1 and 2 now go to a capture file
capture = os.open("/tmp/psrl_test_output.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
os.dup2(capture, 1)
os.dup2(capture, 2)
os.close(capture)
sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True)
sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True)

_write, _dumps, _NO = os.write, json.dumps, object()
def report(rec):
    _write(channel, (token + " " + _dumps(rec) + "\n").encode())

MODULES = [m for n, m in sorted(sys.modules.items()) if n == "unittest" or n.startswith("unittest.")]
CLASSES = [unittest.TestCase, unittest.TestResult, unittest.TextTestResult, unittest.TextTestRunner,
           unittest.TestSuite, unittest.suite.BaseTestSuite, unittest.TestLoader, unittest.FunctionTestCase]
CLASSES += [c for c in (getattr(unittest.case, "_Outcome", None),) if c is not None]

def _codes(ns):
    return {k: v.__code__ for k, v in ns.items() if isinstance(v, types.FunctionType)}

def snapshot():
    return {
        "modules": {m.__name__: (dict(vars(m)), _codes(vars(m))) for m in MODULES},
        "classes": {c.__qualname__: (dict(vars(c)), _codes(vars(c))) for c in CLASSES},
        "builtins": dict(vars(builtins)),
        "sys.modules": dict(sys.modules),
    }

def changes(before):
    found = []
    for name, (ns, codes) in before["modules"].items():
        now = vars(sys.modules.get(name) or types.ModuleType(name))
        found += ["%s.%s" % (name, k) for k, v in ns.items() if now.get(k, _NO) is not v]
        found += ["%s.%s.__code__" % (name, k) for k, c in codes.items() if getattr(ns[k], "__code__", None) is not c]
    for name, (ns, codes) in before["classes"].items():
        cls = next(c for c in CLASSES if c.__qualname__ == name)
        now = vars(cls)
        found += ["%s.%s" % (name, k) for k in set(ns) | set(now) if ns.get(k, _NO) is not now.get(k, _NO)]
        found += ["%s.%s.__code__" % (name, k) for k, c in codes.items() if getattr(ns[k], "__code__", None) is not c]
    now = vars(builtins)
    found += ["builtins.%s" % k for k, v in before["builtins"].items() if now.get(k, _NO) is not v]
    found += ["sys.modules[%r]" % k for k, v in before["sys.modules"].items() if k in sys.modules and sys.modules[k] is not v]
    if sys.gettrace() is not None or sys.getprofile() is not None:
        found.append("sys.settrace/setprofile")
    return sorted(set(found))

def flat(s):
    for x in (s if isinstance(s, unittest.TestSuite) else [s]):
        if isinstance(x, unittest.TestSuite):
            yield from flat(x)
        else:
            yield x

before = snapshot()
sys.path.insert(0, "/workspace")
tampered = []
for tid in test_ids:
    detail, ok, ran = "", False, 0
    try:
        suite = unittest.defaultTestLoader.loadTestsFromName(tid)
        tests = list(flat(suite))
        for t in tests:  # each test must be code of the hidden test file its id names
            modname = type(t).__module__
            expected = os.path.realpath("/workspace/" + modname.replace(".", "/") + ".py")
            method = getattr(type(t), getattr(t, "_testMethodName", ""), None)
            where = os.path.realpath(getattr(getattr(method, "__code__", None), "co_filename", "") or "?")
            if not tid.startswith(modname + ".") or where != expected:
                raise ImportError("test %s is not the hidden test at %s (its code is from %s)" % (t.id(), expected, where))
        result = unittest.TestResult()
        suite.run(result)
        ran = result.testsRun
        ok = result.wasSuccessful() and ran == len(tests) and ran > 0
        detail = "".join(t for _, t in result.failures + result.errors)[-2000:]
    except BaseException as e:
        detail = "%s: %s" % (type(e).__name__, e)
    tampered = changes(before)
    if tampered:
        report({"tampered": tampered[:20]})
        break
    report({"id": tid, "passed": bool(ok), "ran": ran, "detail": detail})
report({"done": len(test_ids)})
os.close(channel)
'''

OUTPUT_FILE = "/tmp/psrl_test_output.txt"  # what the code under test printed (never a result)


@dataclass
class RunnerReport:
    results: dict[str, bool] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)
    tampered: list[str] = field(default_factory=list)
    done: bool = False
    forged_lines: int = 0  # result-like lines without the token (someone tried to speak for the runner)


def read_results(stdout: str, token: str, test_ids: tuple[str, ...]) -> RunnerReport:
    """The runner's own lines (``TOKEN {json}``); anything else on the channel is counted as forged
    when it looks like a result, and otherwise ignored."""
    rep = RunnerReport()
    prefix = token + " "
    for line in stdout.splitlines():
        if not line.startswith(prefix):
            rep.forged_lines += looks_like_result(line, test_ids)
            continue
        try:
            rec = json.loads(line[len(prefix):])
        except json.JSONDecodeError:
            continue
        if "tampered" in rec:
            rep.tampered = [str(x) for x in rec["tampered"]]
        elif "done" in rec:
            rep.done = True
        elif rec.get("id") in test_ids and rec["id"] not in rep.results:
            rep.results[rec["id"]] = bool(rec.get("passed"))
            rep.details[rec["id"]] = str(rec.get("detail", ""))
    return rep


def looks_like_result(line: str, test_ids: tuple[str, ...]) -> bool:
    """A line shaped like the runner's verdict on one of ``test_ids`` (JSON with that ``id`` and
    ``passed``) or its tampering report. Ordinary JSON a program prints does not match: only code
    that knows the hidden test ids can write one."""
    start = line.find("{")
    if start < 0:
        return False
    try:
        rec = json.loads(line[start:])
    except json.JSONDecodeError:
        return any(t in line for t in test_ids) and '"passed"' in line
    return isinstance(rec, dict) and ("tampered" in rec or (rec.get("id") in test_ids and "passed" in rec))
