"""Reward functions computed by the trainer side, outside any sandbox the agent can write to.

``math_reward(solution, ground_truth)``: 1.0 when the last ``\\boxed{...}`` of the solution is
equivalent to the ground truth (same normalized text, same number, or the same expression at
random points), else 0.0. It reads only the model's text and the dataset's answer.
``math_number_reward``: the same, but the box must hold a number: for tasks whose point is to
compute it, where boxing the question's own expression would otherwise count as right.
"""

from __future__ import annotations

import re
from typing import Any

from .mathexpr import equivalent
from .registry import register_reward

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_TEXT_CMD = re.compile(r"\\(?:text|textbf|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d+(\.\d+)?")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "$", "\\displaystyle", "^\\circ", "^{\\circ}", "\\%", "%")


def last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (balanced braces), or None."""
    starts = [m.end() for m in _BOX.finditer(text)]
    for start in reversed(starts):
        depth, i = 1, start
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start : i - 1]
    return None


def normalize_answer(answer: Any) -> str:
    s = str(answer).strip()
    s = _TEXT_CMD.sub(r"\1", s)
    for token in _DROP:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.strip().rstrip(".").strip()
    # "x = 5" -> "5"; a bare variable name on the left is only a label.
    if s.count("=") == 1:
        left, right = s.split("=")
        if re.fullmatch(r"\s*[A-Za-z]\s*", left):
            s = right.strip()
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    return re.sub(r"\s+", " ", s)


def answers_match(given: Any, truth: Any) -> bool:
    a, b = normalize_answer(given), normalize_answer(truth)
    if not a or not b:
        return False
    if a.replace(" ", "") == b.replace(" ", ""):
        return True
    return equivalent(a, b)  # spaces kept: "\pi r" is not "\pir"


@register_reward("math")
def math_reward(solution: str, ground_truth: Any, **_: Any) -> float:
    """1.0 when the last ``\\boxed{}`` answer in ``solution`` equals ``ground_truth``, else 0.0.

    ``ground_truth`` may be a number, a string, or a list of acceptable answers.
    """
    boxed = last_boxed(solution or "")
    return 0.0 if boxed is None else _score(boxed, ground_truth)


def _score(boxed: str, ground_truth: Any) -> float:
    truths = ground_truth if isinstance(ground_truth, list | tuple) else [ground_truth]
    return 1.0 if any(answers_match(boxed, t) for t in truths if t is not None) else 0.0


@register_reward("math_number")
def math_number_reward(solution: str, ground_truth: Any, **_: Any) -> float:
    """``math_reward`` for answers that are numbers to compute (ReTool's arithmetic): the last
    ``\\boxed{}`` must hold a number (``64433``, ``64,433``, ``-3.5``), so a box around the
    question's expression (``\\boxed{811 * 80 - 447}``), which ``math`` evaluates and accepts,
    earns nothing."""
    boxed = last_boxed(solution or "")
    if boxed is None or not _NUMBER.fullmatch(normalize_answer(boxed)):
        return 0.0
    return _score(boxed, ground_truth)


@register_reward("contains_digit")
def contains_digit_reward(solution: str, ground_truth: Any = None, **_: Any) -> float:
    """1 when the reply holds a digit: the quickstart's deliberately easy verifiable task."""
    return 1.0 if any(c.isdigit() for c in solution) else 0.0
