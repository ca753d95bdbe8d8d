"""``psrl envs`` (listing), ``psrl envs new`` (the scaffold and its generated test) and
``psrl envs validate`` (the report and its thresholds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from psrl.cli import main as psrl_main
from psrl.config import load_config
from psrl.environments.dataset import write_rows
from psrl.pipeline.envs_cli import Thresholds
from psrl.pipeline.envs_validate import print_report, summarize, validate
from psrl.testing import ScriptedEngine
from psrl.trajectory import Status, Step, Trajectory

from .adapters_common import reply, tiny_tokenizer

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[2]


def test_envs_without_action_still_lists(capsys):
    assert psrl_main(["envs"]) == 0
    out = capsys.readouterr().out
    for name in ("tool_env", "reasoning_gym_env", "textarena_env", "openenv_env", "verifiers_env", "multi_turn_agent"):
        assert name in out


def test_envs_new_refuses_bad_names_and_existing_dirs(tmp_path, capsys):
    assert psrl_main(["envs", "new", "Bad-Name", "--dir", str(tmp_path)]) == 2
    assert "lowercase Python identifier" in capsys.readouterr().err
    assert psrl_main(["envs", "new", "demo", "--dir", str(tmp_path)]) == 0
    (tmp_path / "demo" / "env.py").write_text("# my edits\n")
    assert psrl_main(["envs", "new", "demo", "--dir", str(tmp_path)]) == 2
    assert "exists already" in capsys.readouterr().err
    assert (tmp_path / "demo" / "env.py").read_text() == "# my edits\n"  # nothing overwritten


def test_generated_package_passes_its_own_tests(tmp_path):
    """As a new user runs it: `psrl envs new demo`, then pytest on the result, from that directory."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-m", "psrl.cli", "envs", "new", "demo"], cwd=tmp_path, env=env, check=True, timeout=120)
    assert {p.name for p in (tmp_path / "demo").iterdir()} >= {"env.py", "agent_data.py", "recipe.yaml", "data", "tests", "README.md"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "demo/tests"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "3 passed" in proc.stdout


@pytest.fixture
def demo(tmp_path, monkeypatch):
    assert psrl_main(["envs", "new", "demo", "--dir", str(tmp_path)]) == 0
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "demo"


def _guesser(tokenizer):
    """Each episode guesses its own deterministic pseudo-random numbers: groups get variance."""

    def script(req):
        h = zlib.crc32(f"{req.session_id}/{len(req.prompt_ids)}".encode())
        return reply(tokenizer, str(h % 10) if h % 7 else "no idea")

    return script


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_validate_reports_a_usable_environment(demo, capsys):
    tokenizer = tiny_tokenizer()
    cfg = load_config(str(demo / "recipe.yaml"), [f"data.train_files=[{demo / 'data' / 'train.jsonl'}]"])
    report = await validate(cfg, groups=8, thresholds=Thresholds(), engine=ScriptedEngine(_guesser(tokenizer)), tokenizer=tokenizer)
    assert (report.groups, report.episodes) == (8, 32)
    assert 0 <= report.reward_min < report.reward_max <= 1 and report.zero_variance_share < 0.5
    assert sum(report.reward_counts.values()) == 32 and set(report.reward_counts) <= {"0", "0.2", "1"}
    assert 0 < report.format_error_rate < 0.5 and report.crash_rate == 0 and report.timeout_rate == 0
    assert report.conformance.startswith("passed") and report.env_step_ms_median is not None
    assert report.turn_s_median > 0 and not report.crossed
    print_report(report)
    assert "verdict" in capsys.readouterr().out


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_validate_flags_crashes_and_flat_rewards(tmp_path):
    tokenizer = tiny_tokenizer()
    data = write_rows(tmp_path / "rows.jsonl", [{"prompt": f"q{i}", "reward_model": {"ground_truth": "1"}} for i in range(4)])
    cfg = load_config(None, [
        f"data.train_files=[{data}]", "*.rollout.agent.env.name=psrl.testing.CrashingEnv", "*.rollout.agent.on_failure=keep_group",
        "*.rollout.sampling.n=2", "*.rollout.multi_turn.enable=true", "*.rollout.agent.default_agent_loop=multi_turn_agent",
        f"sandbox.spec.state_dir={tmp_path / 'sb'}", "sandbox.pool.warm=0",
    ])  # fmt: skip
    report = await validate(cfg, groups=4, thresholds=Thresholds(), engine=ScriptedEngine(lambda r: reply(tokenizer, "x")), tokenizer=tokenizer)
    assert report.crash_rate == 1.0 and report.zero_variance_share == 1.0
    assert any("crashed" in c for c in report.crossed) and any("zero reward variance" in c for c in report.crossed)
    assert "environment crashed" in report.errors[0]
    assert report.conformance.startswith("not run")
    lenient = await validate(
        cfg, groups=4, thresholds=Thresholds(max_crash_rate=1.0, max_zero_variance=1.0),
        engine=ScriptedEngine(lambda r: reply(tokenizer, "x")), tokenizer=tokenizer,
    )  # fmt: skip
    assert not lenient.crossed  # thresholds are options


def test_identical_tool_call_streaks_are_found():
    from psrl.agent_loops.tool_parsers import HermesToolParser

    tokenizer = tiny_tokenizer()
    call = '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(1)"}}</tool_call>'
    other = '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(2)"}}</tool_call>'

    def traj(key, texts):
        steps = [Step(np.asarray(reply(tokenizer, t), np.int32), np.zeros(len(reply(tokenizer, t)), np.float32), np.zeros(len(reply(tokenizer, t)), np.int32)) for t in texts]
        for s in steps:
            s.obs_ids = np.asarray(tokenizer.encode("ok", add_special_tokens=False), np.int32)
        return Trajectory.from_steps(key, "g", np.asarray([1, 2], np.int32), steps, status=Status.TRUNCATED)

    groups = [[traj("g/0", [call, call, call, other, call]), traj("g/1", [call, other, call, "done"])]]
    report = summarize(groups, {}, tokenizer, HermesToolParser(), Thresholds(max_streak=2))
    assert report.max_identical_call_streak == 3
    assert any("same tool call 3 turns in a row" in c for c in report.crossed)


def test_validate_cli_usage_errors(capsys):
    assert psrl_main(["envs", "validate"]) == 2
    assert "needs a recipe YAML, or --env NAME --data FILE" in capsys.readouterr().err
    assert psrl_main(["envs", "validate", "--env", "tool_env"]) == 2
    assert "--env needs --data" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_new_then_validate_with_vllm(tmp_path):
    """The whole new-user path with a real engine: `psrl envs new demo`, `psrl envs validate`."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "1"}
    subprocess.run([sys.executable, "-m", "psrl.cli", "envs", "new", "demo"], cwd=tmp_path, env=env, check=True, timeout=120)
    proc = subprocess.run(
        [sys.executable, "-m", "psrl.cli", "envs", "validate", "demo/recipe.yaml", "--groups", "4", "--json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=840,
    )  # fmt: skip
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == (1 if report["crossed"] else 0), proc.stderr[-3000:]
    assert report["episodes"] == 16 and report["crash_rate"] == 0.0 and report["conformance"].startswith("passed")
