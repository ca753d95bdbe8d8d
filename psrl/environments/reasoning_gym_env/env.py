"""``reasoning_gym_env``: one question of a reasoning-gym generator, graded by its own scorer.

The row's ``env_kwargs`` name the generator and how it was built (``dataset``, ``seed``,
``size``, ``config``) and which entry this row is (``index``). The environment rebuilds that
entry from the generator -- generators are deterministic in (config, seed, index) -- rather than
trusting anything stored in the row, checks that its answer is the row's ground truth, and after
the model's single turn calls ``dataset.score_answer(answer, entry)``: the library's own scorer,
run here, outside any sandbox. The answer is what the model wrote inside ``<answer>...</answer>``
(reasoning-gym's own prompt format; ``answer_format="boxed"`` reads the last ``\\boxed{}``,
``"last_number"`` the last number in the reply -- for small models that do not follow the tag
format yet --, ``"raw"`` the whole reply).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from typing import Any, Literal

from psrl.environments.base import Task
from psrl.environments.chat import ChatObservation, as_messages
from psrl.environments.extras import require
from psrl.environments.registry import register_env
from psrl.environments.rewards import last_boxed

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _config_dict(config: Mapping[str, Any] | str | None) -> dict[str, Any]:
    if config is None or config == "":
        return {}
    if isinstance(config, str):
        config = json.loads(config)
    if not isinstance(config, Mapping):
        raise ValueError(f"reasoning_gym_env: config must be a dict or a JSON object, got {config!r:.100}")
    return dict(config)


@functools.lru_cache(maxsize=64)
def _dataset(name: str, seed: int, size: int, config_json: str) -> Any:
    rg = require("reasoning_gym", "reasoning-gym", adapter="reasoning_gym_env")
    return rg.create_dataset(name, seed=seed, size=size, **json.loads(config_json))


def load_dataset(name: str, *, seed: int, size: int, config: Mapping[str, Any] | str | None = None) -> Any:
    """The reasoning-gym dataset object (cached: building some generators takes a while)."""
    return _dataset(name, int(seed), int(size), json.dumps(_config_dict(config), sort_keys=True))


@register_env("reasoning_gym_env")
class ReasoningGymEnv:
    """Single turn. Metrics: ``format_errors`` (no answer found in the reply), ``correct``."""

    def __init__(
        self,
        *,
        dataset: str | None = None,
        index: int | None = None,
        seed: int = 0,
        size: int = 1000,
        config: Mapping[str, Any] | str | None = None,
        answer_format: Literal["tag", "boxed", "last_number", "raw"] = "tag",
    ) -> None:
        if answer_format not in ("tag", "boxed", "last_number", "raw"):
            raise ValueError(f"reasoning_gym_env: answer_format must be tag, boxed, last_number or raw, got {answer_format!r}")
        self.name, self.index, self.seed, self.size = dataset, index, seed, size
        self.config = _config_dict(config)
        self.answer_format = answer_format
        self._data: Any = None
        self._entry: dict[str, Any] | None = None

    async def reset(self, task: Task) -> tuple[ChatObservation, dict[str, Any]]:
        if not self.name or self.index is None:
            raise ValueError("reasoning_gym_env needs env_kwargs 'dataset' and 'index' (rows from `psrl data reasoning-gym`)")
        self._data = load_dataset(self.name, seed=self.seed, size=self.size, config=self.config)
        entry = self._data[int(self.index)]
        if task.ground_truth is not None and str(task.ground_truth) != str(entry["answer"]):
            raise ValueError(
                f"reasoning_gym_env: {self.name}[{self.index}] (seed {self.seed}) now has answer {entry['answer']!r:.80} but the "
                f"row says {task.ground_truth!r:.80}; the row was made by another reasoning-gym version or config"
            )
        self._entry = entry
        messages = as_messages(task.prompt) if task.prompt else [{"role": "user", "content": entry["question"]}]
        return ChatObservation(messages=messages), {}

    def extract(self, text: str) -> str | None:
        if self.answer_format == "raw":
            return text.strip()
        if self.answer_format == "boxed":
            return last_boxed(text)
        if self.answer_format == "last_number":
            numbers = _NUMBER.findall(text)
            return numbers[-1] if numbers else None
        from reasoning_gym.utils import extract_answer

        return extract_answer(text, tag_name="answer")

    async def step(self, action: Any) -> tuple[ChatObservation, float, bool, dict[str, Any]]:
        if self._entry is None:
            raise RuntimeError("step() before reset()")
        text = getattr(action, "text", action)
        answer = self.extract(text if isinstance(text, str) else str(text))
        reward = float(self._data.score_answer(answer, self._entry)) if answer is not None else 0.0
        metrics = {"format_errors": float(answer is None), "correct": float(reward >= 1.0)}
        return ChatObservation(messages=[]), reward, True, {"metrics": metrics}

    async def aclose(self) -> None:
        self._entry = None
