"""Full rollouts as text, written by the rollout side every few steps, for a human to read.

:class:`RolloutSampleWriter` turns finished trajectories into readable records (the decoded
prompt, every turn's model text with the tool calls parsed from it, the environment's reply,
reward, status, environment metrics) and appends them to ``DIR/step_N.jsonl``, where ``N`` is
the policy version that generated them. Only steps that are multiples of ``every`` are written,
at most ``per_step`` trajectories each. Reading them: ``psrl runs show RUN_DIR --step N``.

Reward hacking shows in text long before it shows in a reward curve: a policy that learned to
print a result line, or to repeat one tool call, is plain to see here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from psrl.log import get_logger
from psrl.trajectory import NO_VERSION, Trajectory

log = get_logger(__name__)


def trajectory_record(traj: Trajectory, tokenizer: Any, tool_parser: Any = None, *, step: int | None = None) -> dict[str, Any]:
    """One trajectory as a JSON-ready dict of decoded text."""

    def decode(ids: Any) -> str:
        return tokenizer.decode([int(i) for i in ids], skip_special_tokens=False) if len(ids) else ""

    turns = []
    bounds = [tuple(map(int, b)) for b in traj.turn_bounds]
    for i, (a, b) in enumerate(bounds):
        end = bounds[i + 1][0] if i + 1 < len(bounds) else len(traj.response_ids)
        model = decode(traj.response_ids[a:b])
        turn: dict[str, Any] = {"model": model, "env": decode(traj.response_ids[b:end])}
        if i < len(traj.turn_rewards):
            turn["reward"] = float(traj.turn_rewards[i])
        calls = _tool_calls(tool_parser, model)
        if calls:
            turn["tool_calls"] = calls
        turns.append(turn)
    return {
        "step": step if step is not None else traj.min_version(),
        "key": traj.key,
        "group_id": traj.group_id,
        "data_source": traj.data_source,
        "reward": float(traj.reward),
        "status": str(traj.status.value if hasattr(traj.status, "value") else traj.status),
        "error": traj.error,
        "env_metrics": {k: float(v) for k, v in traj.env_metrics.items()},
        "prompt": decode(traj.prompt_ids),
        "turns": turns,
    }


def _tool_calls(parser: Any, text: str) -> list[Any]:
    if parser is None or not text:
        return []
    try:
        action = parser.parse(text)
    except Exception:  # noqa: BLE001 - a sample for reading: a parser failure only leaves it out
        return []
    calls = getattr(action, "calls", None) or []
    return [asdict(c) if is_dataclass(c) else str(c) for c in calls]


class RolloutSampleWriter:
    """Appends sampled trajectories to ``root/step_N.jsonl`` (see the module docstring)."""

    def __init__(self, root: str | Path, *, every: int, tokenizer: Any, per_step: int = 8, tool_parser: Any = None) -> None:
        if every < 1 or per_step < 1:
            raise ValueError(f"rollout samples need every >= 1 and per_step >= 1, got {every} and {per_step}")
        self.root, self.every, self.per_step = Path(root), every, per_step
        self.tokenizer, self.tool_parser = tokenizer, tool_parser
        self._written: dict[int, int] = {}

    def record(self, trajectories: Iterable[Trajectory]) -> int:
        """Write the ones that fall on a sampled step and fit its quota; returns how many."""
        lines: dict[int, list[str]] = {}
        for t in trajectories:
            step = t.min_version()
            if step == NO_VERSION or step % self.every or self._written.get(step, 0) >= self.per_step:
                continue
            self._written[step] = self._written.get(step, 0) + 1
            lines.setdefault(step, []).append(json.dumps(trajectory_record(t, self.tokenizer, self.tool_parser, step=step)))
        for step, recs in lines.items():
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                with open(self.root / f"step_{step}.jsonl", "a") as fh:
                    fh.write("\n".join(recs) + "\n")
            except OSError as e:  # samples are for reading: a full disk must not stop training
                log.warning("could not write rollout samples", path=str(self.root), error=str(e))
        return sum(len(v) for v in lines.values())
