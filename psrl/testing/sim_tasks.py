"""Toy tasks with verifiable rewards that the tiny offline model learns in minutes: the
quickstart recipe and the pipeline's learning tests use them.

The ``contains_digit`` reward (``psrl.environments.rewards``) pays 1 for a reply that contains a
digit. A random ``tiny-qwen2`` does so about one time in five with 16 new tokens (10 of its 832 tokens are digits), which gives GRPO groups
with mixed rewards from the first step; a trained policy does so nearly always.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

_ASKS = ("Write a number.", "Say a number.", "Give me a number.", "Pick a number.", "Name a number.", "Any number?")
_TOPICS = ("apples", "steps", "files", "tests", "days", "calls", "people", "answers", "lines", "values")


def digit_task_rows(n: int, *, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
    """veRL-style rows asking for a number, worded in varied ways."""
    rng = random.Random(f"{seed}-{split}")
    rows = []
    for i in range(n):
        prompt = f"{rng.choice(_ASKS)} How many {rng.choice(_TOPICS)}?"
        rows.append({
            "prompt": [{"role": "user", "content": prompt}],
            "data_source": "digits",
            "reward_model": {"ground_truth": "a digit"},
            "extra_info": {"index": i, "split": split},
        })
    return rows


def write_digit_task(directory: str | Path, *, train: int = 256, val: int = 32, seed: int = 0) -> tuple[Path, Path]:
    from psrl.environments.dataset import write_rows

    d = Path(directory)
    return (
        write_rows(d / "train.jsonl", digit_task_rows(train, seed=seed, split="train")),
        write_rows(d / "val.jsonl", digit_task_rows(val, seed=seed, split="val")),
    )


def arithmetic_rows(n: int, *, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
    """Procedural multi-step arithmetic for the ReTool recipe: the answer is an integer checked by
    the ``math`` reward from ``\\boxed{}``; the python tool makes them easy, mental arithmetic not."""
    rng = random.Random(f"arith-{seed}-{split}")
    rows = []
    for i in range(n):
        a, b, c = rng.randint(12, 999), rng.randint(12, 99), rng.randint(2, 999)
        op = rng.choice(["+", "-"])
        answer = a * b + c if op == "+" else a * b - c
        question = (
            f"Compute {a} * {b} {op} {c}. You may run Python with the code_interpreter tool. "
            "Put the final answer in \\boxed{}."
        )
        rows.append({
            "prompt": [{"role": "user", "content": question}],
            "data_source": "procedural_arithmetic",
            "reward_model": {"ground_truth": str(answer)},
            "extra_info": {"index": i, "split": split},
        })
    return rows
