"""ReTool cold-start demonstrations: a scripted policy solves the recipe's task family
(``psrl.testing.sim_tasks.arithmetic_rows``: "Compute A * B +/- C") through the real rollout
path -- the recipe's agent loop, ``tool_agent_data`` codec, Hermes tool-call parser, ``tool_env``
and its bubblewrap sandbox -- so the tool outputs, chat-template tokens and loss masks are exactly
what RL sees. Only rewarded episodes are kept (the ``math`` reward graded them).

A demonstration: a sentence, a ``<tool_call>`` running Python that computes the answer, the
tool's real output, then a turn that states it and puts it in ``\\boxed{}``.
Rows are drawn from ``split="demo"``, so they are not the recipe's train/validation rows.
"""

from __future__ import annotations

import json
import random
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from psrl.config import PSRLConfig, load_config
from psrl.environments.dataset import write_rows
from psrl.testing.sim_tasks import arithmetic_rows

from .data import text_turn_ids

QUESTION = re.compile(r"Compute (\d+) \* (\d+) ([+-]) (\d+)\.")
_NUMBER_LINE = re.compile(r"^\s*(-?\d+)\s*$", re.MULTILINE)
_OPENERS = (
    "Let me compute this with Python.",
    "I'll use the code interpreter to evaluate the expression.",
    "I will calculate {expr} in Python.",
    "To avoid arithmetic mistakes, I'll run the computation in Python.",
)
_CODES = (
    "print({expr})",
    "result = {expr}\nprint(result)",
    "product = {a} * {b}\nprint(product {op} {c})",
)
_CLOSERS = (
    "The code printed {out}, so {expr} = {out}.\n\n\\boxed{{{out}}}",
    "The result is {out}.\n\\boxed{{{out}}}",
    "Python gives {out}. The final answer is \\boxed{{{out}}}.",
)


def demo_turns(question: re.Match, tool_output: str | None, seed: int) -> tuple[str, str | None]:
    """(text of the turn, Python code or None) for a task at a point of the episode: before any
    tool output, a call; after it, the answer read from the tool's output."""
    a, b, op, c = question.groups()
    expr = f"{a} * {b} {op} {c}"
    rng = random.Random(f"{seed}-{expr}")
    opener, code, closer = rng.choice(_OPENERS), rng.choice(_CODES), rng.choice(_CLOSERS)
    if tool_output is None:
        return opener.format(expr=expr), code.format(expr=expr, a=a, b=b, op=op, c=c)
    found = _NUMBER_LINE.search(tool_output)
    if found is None:
        return "I could not read a number in the tool's output.", None
    return closer.format(out=found.group(1), expr=expr), None


def demo_policy(tokenizer: Any, seed: int = 0) -> Callable[[Any], np.ndarray]:
    """A ``ScriptedEngine`` script: reads the episode so far from the request's ids."""

    def script(request: Any) -> np.ndarray:
        text = tokenizer.decode(np.asarray(request.prompt_ids).tolist(), skip_special_tokens=False)
        matches = list(QUESTION.finditer(text))
        if not matches:
            return text_turn_ids(tokenizer, "I cannot find the question.")
        q = matches[-1]
        rest = text[q.end():]
        tool_output = rest.rsplit("</tool_call>", 1)[1] if "</tool_call>" in rest else None
        for special in tokenizer.all_special_tokens if tool_output else ():
            tool_output = tool_output.replace(special, "\n")  # "<|im_start|>tool\n4137<|im_end|>": a line of its own
        say, code = demo_turns(q, tool_output, seed)
        if code is not None:
            call = json.dumps({"name": "code_interpreter", "arguments": {"code": code}})
            say = f"{say}\n<tool_call>{call}</tool_call>"
        return text_turn_ids(tokenizer, say)

    return script


@dataclass(frozen=True)
class DemoSummary:
    output: str
    rows: int
    episodes: int
    kept: int
    reward_mean: float
    wall_s: float


def demo_config(config: str | None, overrides: Sequence[str], data_file: str) -> PSRLConfig:
    return load_config(config, [
        *overrides, f"data.train_files=[{data_file}]", "data.max_samples=null",
        "gen_actor_rollout_ref.rollout.sampling.n=1", "logging.progress_bar=false",
    ])  # fmt: skip


async def make_demos(config: str | None, output: str, *, rows: int, seed: int = 0, overrides: Sequence[str] = (),
                     sandbox_pool: Any = None) -> DemoSummary:
    """Run ``rows`` demo episodes with the recipe ``config`` and write the rewarded trajectories
    to ``output`` (parquet, the ``psrl rollout`` schema: ``psrl sft`` reads it)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from psrl.pipeline.rollout import load_tokenizer, rollout
    from psrl.testing.scripted_engine import ScriptedEngine

    if rows < 1:
        raise ValueError(f"--rows must be at least 1, got {rows}")
    with tempfile.TemporaryDirectory(prefix="psrl-demos-") as tmp:
        data = str(Path(tmp) / "tasks.jsonl")
        write_rows(data, arithmetic_rows(rows, seed=seed, split="demo"))
        cfg = demo_config(config, overrides, data)
        tokenizer = await load_tokenizer(cfg)
        engine = ScriptedEngine(demo_policy(tokenizer, seed), logprob=0.0)
        raw = str(Path(tmp) / "episodes.parquet")
        summary = await rollout(cfg, raw, engine=engine, tokenizer=tokenizer, sandbox_pool=sandbox_pool)
        table = pq.read_table(raw) if Path(raw).is_file() else None
    kept = table.filter(pc.greater(table.column("reward"), 0.0)) if table is not None else None
    if kept is None or kept.num_rows == 0:
        raise RuntimeError(f"no demonstration was rewarded out of {summary.episodes} episodes (failed {summary.failed}): see the logs")
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(kept, output)
    return DemoSummary(output, rows, summary.episodes, kept.num_rows, summary.reward_mean, summary.wall_s)


def run(args: Any) -> int:
    import anyio

    summary = anyio.run(lambda: make_demos(args.config, args.output, rows=args.rows, seed=args.seed, overrides=args.overrides), backend="asyncio")
    print(json.dumps(asdict(summary)))
    return 0
