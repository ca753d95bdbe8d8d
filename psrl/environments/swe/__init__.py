"""The SWE environment family: task repositories in sandboxes, graded by hidden tests.

``mini_swe_env`` + ``mini_swe_agent_data``, driven by the ``mini_swe_agent`` loop (a black-box
agent through the session gateway) or by ``multi_turn_agent``. Grading (``workspace.py``) runs
the hidden tests with an isolated runner (``runner.py``) and flags diffs that game the grader
(``guard.py``; docs/swe_grading.md). Heavy parts import lazily.
"""

from .actions import SUBMIT_MARKER, BashAction, FormatError, Submit, parse_action
from .task import (
    SWETask,
    TaskFormatError,
    builtin_task_ids,
    builtin_tasks,
    load_builtin,
    resolve_task,
)

__all__ = [
    "SUBMIT_MARKER", "BashAction", "FormatError", "SWETask", "Submit", "TaskFormatError", "builtin_task_ids",
    "builtin_tasks", "load_builtin", "parse_action", "resolve_task",
]
