"""Accuracy and tool-call form of a trajectories file (``psrl rollout``, ``psrl data retool-demos``
or evaluation output): ``python -m psrl.sft.stats FILE.parquet [--json]``.

Per episode ``env_metrics`` are the sums of its turns' metrics (``tool_calls``, ``tool_errors``:
malformed calls, unknown tools, bad arguments). An episode is *well formed* when it called a tool
at least once and every call was read and run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def trajectory_stats(path: str | Path) -> dict[str, Any]:
    import pyarrow.parquet as pq

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such file")
    table = pq.read_table(p, columns=None)
    for col in ("reward", "env_metrics"):
        if col not in table.schema.names:
            raise ValueError(f"{p}: no {col!r} column (not a trajectories file)")
    rewards = [float(r or 0.0) for r in table.column("reward").to_pylist()]
    metrics = [dict(m or []) for m in table.column("env_metrics").to_pylist()]
    n = len(rewards)
    if n == 0:
        raise ValueError(f"{p}: no episodes")
    calls = [m.get("tool_calls", 0.0) for m in metrics]
    errors = [m.get("tool_errors", 0.0) for m in metrics]
    total_calls = sum(calls)
    out: dict[str, Any] = {
        "file": str(p),
        "episodes": n,
        "accuracy": sum(r > 0 for r in rewards) / n,
        "reward_mean": sum(rewards) / n,
        "called_tool_rate": sum(c > 0 for c in calls) / n,
        "well_formed_rate": sum(c > 0 and e == 0 for c, e in zip(calls, errors)) / n,
        "tool_calls_per_episode": total_calls / n,
        "call_error_rate": sum(errors) / total_calls if total_calls else 0.0,
        "exec_error_rate": sum(m.get("tool_exec_errors", 0.0) for m in metrics) / total_calls if total_calls else 0.0,
    }
    if "num_turns" in table.schema.names:
        out["turns_mean"] = sum(table.column("num_turns").to_pylist()) / n
    if "status" in table.schema.names:
        out["failed"] = sum(s == "failed" for s in table.column("status").to_pylist())
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m psrl.sft.stats", description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="trajectories parquet files")
    p.add_argument("--json", action="store_true", help="one JSON line per file")
    args = p.parse_args(argv)
    for f in args.files:
        try:
            s = trajectory_stats(f)
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(s))
        else:
            print("  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in s.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
