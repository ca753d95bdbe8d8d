"""``psrl runs show RUN_DIR [--step N]``: the rollout samples a run wrote, rendered for reading.

``psrl train`` writes them to ``RUN_DIR/rollouts/step_N.jsonl`` every
``logging.rollout_samples_every`` steps (``psrl.agent_loops.samples``). Each sample shows its
reward, status and environment metrics, the prompt, then every turn: the model's text, the tool
calls parsed from it and what the environment answered.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("runs", help="inspect training runs")
    rsub = p.add_subparsers(dest="runs_command", required=True, metavar="ACTION")
    show = rsub.add_parser("show", help="render the rollout samples of a step")
    show.add_argument("run_dir", help="the run's logging.output_dir")
    show.add_argument("--step", type=int, default=None, help="which step (default: the latest with samples)")
    show.add_argument("--limit", type=int, default=None, help="show at most this many samples")
    show.add_argument("--max-chars", type=int, default=4000, help="cut each text to this many characters (0: no cut)")


def sample_steps(run_dir: Path) -> list[int]:
    root = run_dir / "rollouts"
    steps = [p.stem[5:] for p in root.glob("step_*.jsonl")] if root.is_dir() else []
    return sorted(int(s) for s in steps if s.isdigit())


def load_samples(run_dir: Path, step: int) -> list[dict[str, Any]]:
    path = run_dir / "rollouts" / f"step_{step}.jsonl"
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not a JSON line ({e})") from None
    return out


def run(args: argparse.Namespace, file: Any = None) -> int:
    run_dir = Path(args.run_dir)
    steps = sample_steps(run_dir)
    if not steps:
        print(f"psrl runs show: error: no rollout samples in {run_dir / 'rollouts'} "
              "(psrl train writes them every logging.rollout_samples_every steps)", file=sys.stderr)
        return 2
    step = steps[-1] if args.step is None else args.step
    if step not in steps:
        print(f"psrl runs show: error: no samples for step {step} in {run_dir / 'rollouts'}; steps with samples: "
              f"{', '.join(map(str, steps))}", file=sys.stderr)
        return 2
    try:
        samples = load_samples(run_dir, step)
    except ValueError as e:
        print(f"psrl runs show: error: {e}", file=sys.stderr)
        return 2
    render(samples[: args.limit] if args.limit else samples, step, max_chars=args.max_chars, file=file)
    return 0


def render(samples: list[dict[str, Any]], step: int, *, max_chars: int = 4000, file: Any = None) -> None:
    from rich.console import Console, Group
    from rich.panel import Panel
    from rich.text import Text

    console = Console(file=file or sys.stdout, width=None if (file or sys.stdout).isatty() else 120)

    def cut(text: str) -> str:
        if max_chars and len(text) > max_chars:
            return f"{text[:max_chars]}\n[... {len(text) - max_chars} more characters]"
        return text

    console.rule(f"step {step}: {len(samples)} rollout samples")
    for s in samples:
        parts: list[Any] = []
        metrics = "  ".join(f"{k}={v:g}" for k, v in sorted((s.get("env_metrics") or {}).items()))
        if metrics:
            parts.append(Text(metrics, style="dim"))
        if s.get("error"):
            parts.append(Text(f"error: {s['error']}", style="bold red"))
        parts.append(Panel(Text(cut(s.get("prompt", ""))), title="prompt", title_align="left", border_style="white"))
        for i, turn in enumerate(s.get("turns", [])):
            reward = f"  reward {turn['reward']:g}" if "reward" in turn else ""
            parts.append(Panel(Text(cut(turn.get("model", ""))), title=f"turn {i}: model{reward}", title_align="left", border_style="green"))
            for call in turn.get("tool_calls") or []:
                parts.append(Text(f"tool call: {json.dumps(call)}", style="yellow"))
            if turn.get("env"):
                parts.append(Panel(Text(cut(turn["env"])), title=f"turn {i}: environment", title_align="left", border_style="blue"))
        title = (f"{s.get('key', '?')}  [{s.get('data_source') or '-'}]  reward {float(s.get('reward', 0.0)):g}  "
                 f"status {s.get('status', '?')}")
        console.print(Panel(Group(*parts), title=title, title_align="left"))
