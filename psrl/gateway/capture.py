"""What a session's calls produced, and their merge into trajectories by token prefix.

Every call is recorded with the exact ids the engine consumed and produced. A call whose prompt
starts with an earlier sample's full sequence (its prompt, then every output and observation
since) continues that sample: the ids in between are observation tokens (loss mask 0, version
-1). A call that extends no sample starts a new one. Nothing is re-tokenized.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from psrl.engines.base import FinishReason
from psrl.trajectory import Status, Step, Trajectory


@dataclass(frozen=True)
class CapturedCall:
    index: int
    request_id: str
    endpoint: str  # "chat" | "completions"
    prompt_ids: np.ndarray
    output_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: FinishReason
    latency_s: float


@dataclass
class _Sample:
    prompt_ids: np.ndarray
    steps: list[Step]
    seq: np.ndarray  # prompt + everything after it so far
    calls: list[int] = field(default_factory=list)


def merge_calls(calls: Sequence[CapturedCall]) -> list[_Sample]:
    samples: list[_Sample] = []
    for call in calls:
        target = None
        for s in reversed(samples):  # the most recent thread first
            n = len(s.seq)
            if len(call.prompt_ids) >= n and np.array_equal(call.prompt_ids[:n], s.seq):
                target = s
                break
        if target is None:
            target = _Sample(call.prompt_ids, [], call.prompt_ids)
            samples.append(target)
        else:  # the ids between the last output and this prompt are what the agent appended
            target.steps[-1].obs_ids = call.prompt_ids[len(target.seq) :]
        target.steps.append(Step(action_ids=call.output_ids, logprobs=call.logprobs, versions=call.versions))
        target.seq = np.concatenate([call.prompt_ids, call.output_ids])
        target.calls.append(call.index)
    return samples


class SessionCapture:
    """The calls of one session, in order. Read it after the session closed."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.calls: list[CapturedCall] = []
        self.failed_calls = 0  # engine errors (nothing to train on, counted for metrics)
        self.tool_call_errors = 0  # tool calls the model wrote that could not be read
        self.closed_reason: str | None = None  # set when the session closes

    def record(self, call: CapturedCall) -> None:
        self.calls.append(call)

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    def trajectories(
        self,
        key: str | None = None,
        group_id: str = "",
        *,
        reward: float = 0.0,
        status: Status = Status.OK,
        error: str | None = None,
        env_metrics: dict[str, float] | None = None,
        data_source: str = "",
    ) -> list[Trajectory]:
        """One trajectory per sample, in the order samples started. The first keeps ``key``;
        later ones get ``key/1``, ``key/2``... Each gets the episode's reward and status."""
        base = key or self.session_id
        out = []
        for i, sample in enumerate(merge_calls(self.calls)):
            out.append(
                Trajectory.from_steps(
                    base if i == 0 else f"{base}/{i}",
                    group_id,
                    sample.prompt_ids,
                    sample.steps,
                    reward=reward,
                    status=status,
                    error=error,
                    env_metrics=env_metrics,
                    data_source=data_source,
                )
            )
        return out
