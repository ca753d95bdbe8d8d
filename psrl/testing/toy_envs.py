"""Toy environments and a byte-level AgentData, for tests and for users' examples."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from psrl.environments.base import Task


class ByteAgentData:
    """Text <-> token ids where every UTF-8 byte is one token (ids 0..255). No tokenizer needed."""

    vocab_size = 256

    def __init__(self, prefix: str = "", suffix: str = "") -> None:
        self.prefix, self.suffix = prefix, suffix

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode(), np.uint8).astype(np.int32)

    def decode(self, ids: np.ndarray) -> str:
        return bytes(np.asarray(ids, np.int64).clip(0, 255).astype(np.uint8)).decode(errors="replace")

    def obs_to_tokens(self, obs: Any, *, first: bool) -> np.ndarray:
        text = obs if isinstance(obs, str) else str(obs)
        return self.encode(text if first else f"{self.prefix}{text}{self.suffix}")

    def tokens_to_action(self, output_ids: np.ndarray) -> str:
        return self.decode(output_ids)


class GuessNumberEnv:
    """Multi-turn: guess a secret integer; the env answers 'higher' or 'lower'.

    Task: ``ground_truth`` is the secret. Reward 1 when guessed, else 0. A non-number is an
    error observation, not an exception.
    """

    def __init__(self, max_guesses: int = 8) -> None:
        self.max_guesses = max_guesses
        self._secret: int | None = None
        self._guesses = 0
        self.closed = False

    async def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        self._secret = int(task.ground_truth)
        self._guesses = 0
        prompt = task.prompt if isinstance(task.prompt, str) else "Guess the number."
        return prompt, {}

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self._secret is None:
            raise RuntimeError("step() before reset()")
        self._guesses += 1
        m = re.search(r"-?\d+", action)
        if m is None:
            return "error: answer with a number", 0.0, self._guesses >= self.max_guesses, {"metrics": {"parse_errors": 1.0}}
        guess = int(m.group())
        if guess == self._secret:
            return "correct", 1.0, True, {}
        hint = "higher" if guess < self._secret else "lower"
        return hint, 0.0, self._guesses >= self.max_guesses, {}

    async def aclose(self) -> None:
        self.closed = True


class EchoEnv:
    """Single turn: reward 1 when the action contains ``task.ground_truth``."""

    def __init__(self) -> None:
        self._target = ""

    async def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        self._target = str(task.ground_truth)
        return task.prompt if isinstance(task.prompt, str) else str(task.prompt), {}

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        return "", float(self._target in action), True, {}

    async def aclose(self) -> None:
        pass


class CrashingEnv:
    """Raises on the given call (``"reset"`` or ``"step"``): for testing failure handling."""

    def __init__(self, crash_on: str = "step", message: str = "environment crashed") -> None:
        self.crash_on, self.message = crash_on, message
        self.closed = False

    async def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        if self.crash_on == "reset":
            raise RuntimeError(self.message)
        return str(task.prompt), {}

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        raise RuntimeError(self.message)

    async def aclose(self) -> None:
        self.closed = True
