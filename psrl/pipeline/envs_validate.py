"""``psrl envs validate``: is an environment fit to train on? Runs ``groups`` GRPO groups with
the configured model and reports what makes an environment useless or dangerous for training.

- zero-variance groups: every episode of the group got the same reward (GRPO learns nothing);
- reward range and distribution;
- format errors (model turns counted by the env metrics ``format_errors``, ``parse_errors`` or
  ``invalid_moves``, over all turns) and tool-call errors (``tool_errors`` / ``tool_calls``);
- timeouts and crashes (FAILED episodes: timed out / any other error);
- identical-tool-call streaks: the same call (name and arguments) on consecutive turns, a
  warning sign of a loop or of reward hacking;
- time per model turn (episode wall time / turns) and, from a scripted replay, ``env.step`` time.

Where the environment is deterministic under scripted actions (the first episode's own actions,
replayed), ``psrl.testing.check_environment`` runs too; a conformance failure is a finding.
Thresholds are options; any crossed one makes the exit code 1.
"""

from __future__ import annotations

import contextlib
import sys
import statistics
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np

from psrl.agent_loops.registry import resolve_components
from psrl.agent_loops.tool_parsers import make_tool_parser
from psrl.config import ConfigError, PSRLConfig
from psrl.environments import ComponentContext, build_component
from psrl.environments.dataset import DatasetError, load_rows, row_to_task
from psrl.trajectory import Status, Trajectory

from .envs_cli import Thresholds
from .metrics import episode_rates
from .rollout import load_tokenizer, open_runner


@dataclass
class Report:
    groups: int = 0
    episodes: int = 0
    zero_variance_share: float = 0.0
    reward_min: float = 0.0
    reward_max: float = 0.0
    reward_mean: float = 0.0
    reward_std: float = 0.0
    reward_counts: dict[str, int] = field(default_factory=dict)  # the most common values
    format_error_rate: float = 0.0
    tool_calls: float = 0.0
    tool_error_rate: float = 0.0
    timeout_rate: float = 0.0
    crash_rate: float = 0.0
    truncated_rate: float = 0.0
    max_identical_call_streak: int = 0
    turn_s_median: float = 0.0
    turn_s_p95: float = 0.0
    env_step_ms_median: float | None = None
    conformance: str = "not run"
    errors: list[str] = field(default_factory=list)  # distinct errors of failed episodes (first few)
    crossed: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _identical_call_streak(traj: Trajectory, tokenizer: Any, parser: Any) -> int:
    """The longest run of consecutive turns that made the same non-empty set of tool calls."""
    best = run = 0
    prev = None
    for start, end in np.asarray(traj.turn_bounds).reshape(-1, 2):
        text = tokenizer.decode(traj.response_ids[start:end].tolist(), skip_special_tokens=True)
        calls = getattr(parser.parse(text), "calls", [])
        sig = tuple(sorted((c.name, repr(sorted(c.arguments.items()))) for c in calls)) or None
        run = run + 1 if sig is not None and sig == prev else (1 if sig is not None else 0)
        prev = sig
        best = max(best, run)
    return best


def summarize(groups: Sequence[Sequence[Trajectory]], finish_s: Mapping[str, float], tokenizer: Any, parser: Any, th: Thresholds) -> Report:
    trajs = [t for g in groups for t in g]
    r = Report(groups=len(groups), episodes=len(trajs))
    if not trajs:
        r.crossed.append("no episodes ran")
        return r
    rewards = np.array([t.reward for t in trajs], np.float64)
    r.reward_min, r.reward_max = float(rewards.min()), float(rewards.max())
    r.reward_mean, r.reward_std = float(rewards.mean()), float(rewards.std())
    r.reward_counts = {f"{v:g}": c for v, c in Counter(np.round(rewards, 4).tolist()).most_common(8)}
    scored = [g for g in groups if len(g) > 1]
    flat = [g for g in scored if len({round(t.reward, 6) for t in g}) == 1]
    r.zero_variance_share = len(flat) / len(scored) if scored else 1.0
    rates = episode_rates(trajs)
    r.format_error_rate, r.tool_calls, r.tool_error_rate = rates.format_error_rate, rates.tool_calls, rates.tool_error_rate
    r.timeout_rate, r.crash_rate, r.truncated_rate = rates.timeout_rate, rates.crash_rate, rates.truncated_rate
    failed = [t for t in trajs if t.status is Status.FAILED]
    r.errors = list(dict.fromkeys((t.error or "")[:300] for t in failed))[:5]
    r.max_identical_call_streak = max(_identical_call_streak(t, tokenizer, parser) for t in trajs) if tokenizer is not None else 0
    per_turn = [finish_s[t.key] / max(t.num_turns, 1) for t in trajs if t.key in finish_s]
    if per_turn:
        r.turn_s_median = statistics.median(per_turn)
        r.turn_s_p95 = float(np.percentile(per_turn, 95))
    checks = [
        (r.zero_variance_share > th.max_zero_variance, f"{r.zero_variance_share:.0%} of groups have zero reward variance (max {th.max_zero_variance:.0%})"),
        (r.crash_rate > th.max_crash_rate, f"{r.crash_rate:.1%} of episodes crashed (max {th.max_crash_rate:.1%})"),
        (r.timeout_rate > th.max_timeout_rate, f"{r.timeout_rate:.1%} of episodes timed out (max {th.max_timeout_rate:.1%})"),
        (r.format_error_rate > th.max_format_error_rate, f"{r.format_error_rate:.0%} of model turns had format errors (max {th.max_format_error_rate:.0%})"),
        (r.tool_error_rate > th.max_tool_error_rate, f"{r.tool_error_rate:.0%} of tool calls failed (max {th.max_tool_error_rate:.0%})"),
        (r.max_identical_call_streak > th.max_streak, f"an episode repeated the same tool call {r.max_identical_call_streak} turns in a row (max {th.max_streak})"),
    ]
    r.crossed.extend(msg for bad, msg in checks if bad)
    return r


async def _replay(rollout: Any, row: Mapping[str, Any], traj: Trajectory, tokenizer: Any, report: Report, timeout_s: float) -> None:
    """Replay the episode's own actions: time ``env.step``, then run ``check_environment`` when
    two replays agree (a non-deterministic env is reported, not failed)."""
    from psrl.testing import ConformanceError, check_environment

    comp = resolve_components(row, rollout.agent)  # the row's env_kwargs merged in
    parser = make_tool_parser(rollout.agent.tool_parser, tokenizer)
    ctx = ComponentContext(tokenizer=tokenizer, tool_parser=parser, observation_mode=getattr(comp.agent_loop_cls, "observation_mode", "chat"))
    data = build_component(comp.data_cls, ctx, comp.data_kwargs)
    actions = [data.tokens_to_action(traj.response_ids[s:e]) for s, e in np.asarray(traj.turn_bounds).reshape(-1, 2)]
    # Malformed turns, through the codec so that they have the env's own action type.
    garbage = np.asarray(tokenizer.encode("\x00 <tool_call>{not json</tool_call> \ufffd", add_special_tokens=False), np.int32)
    bad_actions = [build_component(comp.data_cls, ctx, comp.data_kwargs).tokens_to_action(ids) for ids in (garbage, np.zeros(0, np.int32))]

    def factory() -> Any:
        return build_component(comp.env_cls, ctx, comp.env_kwargs)

    async def run_once() -> tuple[list[Any], list[float]]:
        env, trace, times = factory(), [], []
        try:
            trace.append(repr(await env.reset(row_to_task(row))))
            for action in actions:
                t0 = time.perf_counter()
                out = tuple(await env.step(action))
                times.append(time.perf_counter() - t0)
                trace.append(repr(out[:3]))
                if out[2]:
                    break
        finally:
            with anyio.CancelScope(shield=True):
                await env.aclose()
        return trace, times

    try:
        with anyio.fail_after(timeout_s):
            a, times = await run_once()
            b, _ = await run_once()
    except Exception as e:  # noqa: BLE001 - reported as a finding
        report.conformance = f"replay failed: {type(e).__name__}: {e}"[:400]
        report.crossed.append("replaying an episode's actions failed")
        return
    if times:
        report.env_step_ms_median = statistics.median(times) * 1e3
    if a != b:
        report.conformance = "skipped: the environment is not deterministic under scripted actions"
        return
    try:
        await check_environment(factory, row_to_task(row), actions, bad_actions=bad_actions, timeout_s=timeout_s)
        report.conformance = f"passed ({len(actions)} scripted actions)"
    except ConformanceError as e:
        report.conformance = f"FAILED: {e}"[:400]
        report.crossed.append("psrl.testing.check_environment failed")


async def validate(cfg: PSRLConfig, *, groups: int, thresholds: Thresholds, engine: Any = None, tokenizer: Any = None, conformance: bool = True) -> Report:
    """Run ``groups`` rows x ``sampling.n`` episodes of the training rollout subtree; report."""
    gen = cfg.gen_actor_rollout_ref
    try:
        rows = load_rows(cfg.data.train_files, max_rows=groups)
    except DatasetError as e:
        raise ConfigError(str(e)) from None
    if tokenizer is None:
        tokenizer = await load_tokenizer(cfg)
    async with contextlib.AsyncExitStack() as stack:
        runner, engine = await open_runner(stack, cfg, tokenizer, engine=engine)
        start = time.perf_counter()
        finish: dict[str, float] = {}
        result: list[list[Trajectory]] = [[] for _ in rows]

        def done(t: Trajectory) -> None:
            finish[t.key] = time.perf_counter() - start

        async def one(i: int, row: Mapping[str, Any]) -> None:
            result[i] = await runner.run_group(row, group_id=f"v{i}", engine=engine, on_trajectory=done)

        async with anyio.create_task_group() as tg:
            for i, row in enumerate(rows):
                tg.start_soon(one, i, row)
        parser = make_tool_parser(gen.rollout.agent.tool_parser, tokenizer)
        report = summarize(result, finish, tokenizer, parser, thresholds)
        first = next((g[0] for g in result if g and g[0].status is not Status.FAILED and g[0].num_turns), None)
        if conformance and first is not None:
            await _replay(gen.rollout, rows[int(first.group_id[1:])], first, tokenizer, report, gen.rollout.multi_turn.episode_timeout_s)
        elif conformance:
            report.conformance = "not run: no episode finished to replay"
    return report


def print_report(report: Report, file: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    r = report
    table = Table(title="psrl envs validate", show_header=False)
    rows = [
        ("groups x episodes", f"{r.groups} groups, {r.episodes} episodes"),
        ("zero-variance groups", f"{r.zero_variance_share:.0%}"),
        ("reward", f"min {r.reward_min:g}  max {r.reward_max:g}  mean {r.reward_mean:.3f}  std {r.reward_std:.3f}"),
        ("reward values", "  ".join(f"{k}: {v}" for k, v in r.reward_counts.items())),
        ("format errors", f"{r.format_error_rate:.0%} of model turns"),
        ("tool calls / error rate", f"{r.tool_calls:g} / {r.tool_error_rate:.0%}"),
        ("timeouts / crashes", f"{r.timeout_rate:.1%} / {r.crash_rate:.1%}"),
        ("truncated", f"{r.truncated_rate:.0%}"),
        ("longest identical-call streak", str(r.max_identical_call_streak)),
        ("time per model turn", f"median {r.turn_s_median:.2f} s, p95 {r.turn_s_p95:.2f} s"),
        ("env.step (replay)", "-" if r.env_step_ms_median is None else f"median {r.env_step_ms_median:.2f} ms"),
        ("conformance", r.conformance),
        *[("error", e) for e in r.errors],
        ("verdict", "OK" if not r.crossed else "NOT FIT: " + "; ".join(r.crossed)),
    ]
    for k, v in rows:
        table.add_row(k, v)
    Console(file=file or sys.stdout, width=160).print(table)
