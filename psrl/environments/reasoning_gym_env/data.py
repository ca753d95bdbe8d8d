"""``psrl data reasoning-gym NAME --size N -o train.parquet``: veRL-style rows from a generator.

Each row: ``prompt`` (reasoning-gym's system prompt, then the question), ``data_source``
(``reasoning_gym/NAME``), ``reward_model.ground_truth`` (the generator's answer),
``extra_info`` (the index and the entry's metadata as JSON, for reading only), ``env_class``
(``reasoning_gym_env``) and ``env_kwargs`` (generator name, seed, size, config, index: what the
environment needs to rebuild the entry and score it).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from psrl.environments.dataset import write_rows
from psrl.environments.extras import require

from .env import load_dataset


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def make_rows(name: str, *, size: int, seed: int = 0, config: dict[str, Any] | None = None, system_prompt: str = "default") -> list[dict[str, Any]]:
    rg_utils = require("reasoning_gym.utils", "reasoning-gym", adapter="reasoning_gym_env")
    try:
        data = load_dataset(name, seed=seed, size=size, config=config or {})
    except ValueError as e:  # an unknown generator name: reasoning-gym's error lists nothing
        import reasoning_gym.factory as factory

        known = ", ".join(sorted(factory.DATASETS))
        raise ValueError(f"reasoning-gym generator {name!r}: {e}. Known: {known}") from None
    system = None if system_prompt == "none" else rg_utils.SYSTEM_PROMPTS.get(system_prompt, system_prompt)
    config_json = json.dumps(config or {}, sort_keys=True)
    rows = []
    for i in range(size):
        entry = data[i]
        prompt = [{"role": "user", "content": entry["question"]}]
        if system:
            prompt.insert(0, {"role": "system", "content": system})
        rows.append({
            "prompt": prompt,
            "data_source": f"reasoning_gym/{name}",
            "reward_model": {"ground_truth": "" if entry["answer"] is None else str(entry["answer"])},
            "extra_info": {"index": i, "metadata": json.dumps(entry.get("metadata", {}), default=str)},
            "env_class": "reasoning_gym_env",
            "env_kwargs": {"dataset": name, "seed": seed, "size": size, "config": config_json, "index": i},
        })  # fmt: skip
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="generator name, e.g. basic_arithmetic (reasoning_gym.factory.DATASETS)")
    p.add_argument("--size", type=int, required=True, help="number of rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", required=True, help="output .parquet or .jsonl")
    p.add_argument("--config", nargs="*", default=[], metavar="KEY=VALUE", help="generator config, values as JSON (e.g. max_terms=3)")
    p.add_argument("--system-prompt", default="default", help="a reasoning_gym.utils.SYSTEM_PROMPTS name, literal text, or 'none'")


def run(args: argparse.Namespace) -> int:
    config: dict[str, Any] = {}
    for item in args.config:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--config takes KEY=VALUE, got {item!r}")
        config[key] = _parse_value(value)
    if args.size < 1:
        raise ValueError(f"--size must be at least 1, got {args.size}")
    rows = make_rows(args.name, size=args.size, seed=args.seed, config=config, system_prompt=args.system_prompt)
    path = write_rows(args.output, rows)
    print(f"wrote {len(rows)} rows of reasoning_gym/{args.name} to {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="psrl data reasoning-gym")
    add_arguments(p)
    return run(p.parse_args(argv))
