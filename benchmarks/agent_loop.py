"""Agent-loop overhead: the rollout runner against a bare hand-written loop, same calls.

10,000 concurrent episodes x 8 turns against ``ScriptedEngine`` and an in-memory environment
with the byte-level AgentData, in one process. Both sides make the same engine, env and codec
calls and build the same Trajectory; the difference is what the runner adds per episode and turn
(component resolution and building, the concurrency limiter, timeouts, abort-on-cancel, metrics,
failure policy). Times are this process's CPU time (one thread does all the work), so other
load on the machine disturbs them less than wall time would. Prints a table, then with ``--json`` one JSON line:
``per_turn_us``, ``bare_per_turn_us``, ``ratio`` (goal <= 1.3), ``episodes``, ``peak_rss_mb``.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import time
from typing import Any

import anyio
import numpy as np

from psrl.agent_loops.runner import RolloutRunner
from psrl.config import RolloutConfig
from psrl.engines import GenerateRequest, SamplingParams
from psrl.environments import Task
from psrl.testing import ByteAgentData, ScriptedEngine
from psrl.trajectory import Step, Trajectory


class CountdownEnv:
    """In memory: answers every turn with a short observation; done after ``turns`` steps."""

    def __init__(self, turns: int = 8) -> None:
        self.turns = turns
        self._left = 0

    async def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        self._left = self.turns
        return "count down", {}

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        self._left -= 1
        done = self._left <= 0
        return f"{self._left} left", float(done), done, {"metrics": {"steps": 1.0}}

    async def aclose(self) -> None:
        pass


OUTPUT = np.frombuffer(b"next!", np.uint8).astype(np.int32)


def _config(episodes: int, turns: int) -> RolloutConfig:
    return RolloutConfig.model_validate(
        {
            "sampling": {"n": 1, "max_tokens": 16},
            "multi_turn": {"enable": True, "max_turns": turns, "max_response_length": 100_000, "episode_timeout_s": 3600},
            "agent": {
                "default_agent_loop": "multi_turn_agent",
                "env": {"name": "benchmarks.agent_loop.CountdownEnv", "kwargs": {"turns": turns}},
                "data": {"name": "psrl.testing.ByteAgentData"},
                "max_concurrency": episodes,
                "on_failure": "drop_group",
            },
        }
    )


async def _runner(episodes: int, turns: int) -> tuple[float, int]:
    engine = ScriptedEngine(lambda req: OUTPUT)
    runner = RolloutRunner(_config(episodes, turns))
    rows = [{"prompt": "count down"}] * episodes
    start = time.process_time()
    result = await runner.run_batch(rows, engine=engine)
    elapsed = time.process_time() - start
    assert not result.dropped and all(t.num_turns == turns for t in result.trajectories), "runner episodes went wrong"
    return elapsed, sum(t.num_turns for t in result.trajectories)


async def _bare_episode(engine: ScriptedEngine, turns: int, i: int, out: list) -> None:
    env, data = CountdownEnv(turns), ByteAgentData()
    sampling = SamplingParams(max_tokens=16)
    task = Task(prompt="count down")
    obs, _ = await env.reset(task)
    prompt = context = data.obs_to_tokens(obs, first=True)
    steps = []
    for _ in range(turns):
        result = await engine.generate(GenerateRequest(context, sampling, session_id=str(i)))
        step = Step(result.output_ids, result.logprobs, result.versions)
        steps.append(step)
        obs, reward, done, _ = await env.step(data.tokens_to_action(result.output_ids))
        step.reward = reward
        if done:
            break
        step.obs_ids = data.obs_to_tokens(obs, first=False)
        context = np.concatenate((context, result.output_ids, step.obs_ids))
    await env.aclose()
    out[i] = Trajectory.from_steps(str(i), str(i), prompt, steps)


async def _bare(episodes: int, turns: int) -> tuple[float, int]:
    engine = ScriptedEngine(lambda req: OUTPUT)
    out: list = [None] * episodes
    start = time.process_time()
    async with anyio.create_task_group() as tg:
        for i in range(episodes):
            tg.start_soon(_bare_episode, engine, turns, i, out)
    elapsed = time.process_time() - start
    return elapsed, sum(t.num_turns for t in out)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="psrl bench agent-loop", description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=10_000)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="best of this many runs per side")
    ap.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    ap.add_argument("--json", action="store_true", help="print one JSON line last")
    args = ap.parse_args(argv)

    runs: dict[str, list[float]] = {"runner": [], "bare": []}
    turns_done = {}
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits both sides
        for name, fn in (("bare", _bare), ("runner", _runner)):
            gc.collect()
            elapsed, turns = anyio.run(fn, args.episodes, args.turns, backend=args.backend)
            runs[name].append(elapsed)
            turns_done[name] = turns
    per_turn = {k: min(v) / turns_done[k] * 1e6 for k, v in runs.items()}
    figures = {
        "per_turn_us": round(per_turn["runner"], 2),
        "bare_per_turn_us": round(per_turn["bare"], 2),
        "ratio": round(per_turn["runner"] / per_turn["bare"], 3),
        "episodes": args.episodes,
        "turns": args.turns,
        "peak_rss_mb": round(_peak_rss_mb(), 1),
        "backend": args.backend,
    }
    print(f"{'':24}{'per turn (us)':>16}{'best CPU (s)':>16}")
    print(f"{'runner (psrl)':24}{per_turn['runner']:>16.2f}{min(runs['runner']):>16.3f}")
    print(f"{'bare hand-written loop':24}{per_turn['bare']:>16.2f}{min(runs['bare']):>16.3f}")
    print(f"ratio {figures['ratio']} (goal <= 1.3), {args.episodes} episodes x {args.turns} turns, peak RSS {figures['peak_rss_mb']} MB")
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
