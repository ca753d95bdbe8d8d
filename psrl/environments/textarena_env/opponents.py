"""Fixed opponents for ``textarena_env``: a function of (observation text, rng) -> move.

``random_valid`` / ``first_valid`` read the moves a game lists as ``'[4]'``, ``'[e2e4]'`` in its
observation (TicTacToe, ConnectFour, Chess and many others do); a list of strings plays those
moves in order (then repeats the last one); any other string is a ``module:function`` path to a
user's ``f(observation: str, rng: random.Random) -> str``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from typing import Any

from psrl.registry import import_path

Opponent = Callable[[str, random.Random], str]
_LISTED_MOVE = re.compile(r"'(\[[^\]\n]{1,40}\])'")


def listed_moves(observation: str) -> list[str]:
    """The moves of the last line that lists any (``Available Moves: '[0]', '[1]'``)."""
    for line in reversed(observation.splitlines()):
        moves = _LISTED_MOVE.findall(line)
        if moves:
            return moves
    return []


def _pick(first: bool) -> Opponent:
    def play(observation: str, rng: random.Random) -> str:
        moves = listed_moves(observation)
        if not moves:
            raise ValueError(
                "the opponent found no listed moves ('[x]') in its observation; give textarena_env "
                "opponent=[...moves] or a module:function opponent for this game"
            )
        return moves[0] if first else rng.choice(moves)

    return play


def _script(moves: Sequence[str]) -> Opponent:
    state = {"i": 0}

    def play(observation: str, rng: random.Random) -> str:
        move = moves[min(state["i"], len(moves) - 1)]
        state["i"] += 1
        return move

    return play


def make_opponent(spec: Any) -> Opponent:
    if isinstance(spec, list | tuple):
        if not spec or not all(isinstance(m, str) for m in spec):
            raise ValueError(f"textarena_env: a scripted opponent is a non-empty list of move strings, got {spec!r:.100}")
        return _script(list(spec))
    if spec == "random_valid":
        return _pick(first=False)
    if spec == "first_valid":
        return _pick(first=True)
    if isinstance(spec, str) and (":" in spec or "." in spec):
        fn = import_path(spec)
        if not callable(fn):
            raise ValueError(f"textarena_env: opponent {spec!r} is not callable")
        return fn
    raise ValueError(f"textarena_env: unknown opponent {spec!r}; use random_valid, first_valid, a list of moves, or module:function")
