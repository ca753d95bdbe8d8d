"""A verifiers (v1) taskset defined locally with its dataset in memory, for the adapter tests."""

from __future__ import annotations

import re

import verifiers.v1 as vf

__all__ = ["ArithTaskset"]

PROBLEMS = [("What is 2 + 3?", "5"), ("What is 7 - 4?", "3"), ("What is 6 * 7?", "42")]


class ArithData(vf.TaskData):
    answer: str


def _last_number(text: str) -> str | None:
    numbers = re.findall(r"-?\d+", text)
    return numbers[-1] if numbers else None


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        return float(_last_number(trace.last_reply) == task.answer)

    @vf.metric
    async def model_turns(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages))

    @vf.stop
    async def answered(self, trace: vf.Trace) -> bool:
        return _last_number(trace.last_reply) == self.data.answer


class ArithTaskset(vf.Taskset[ArithTask, vf.TasksetConfig]):
    def load(self):
        for question, answer in PROBLEMS:
            yield ArithTask(ArithData(prompt=question, answer=answer, system_prompt="Answer with a number."), self.config.task)


def try_again(task: ArithTask, trace: vf.Trace) -> str | None:
    """The user of the multi-turn variant: asks again, at most twice."""
    return "That is not right, try again." if len(trace.assistant_messages) < 3 else None
