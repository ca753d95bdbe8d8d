"""``mini_swe_env`` on real bubblewrap sandboxes: tasks, grading apart from the agent, limits."""

from __future__ import annotations

import anyio
import pytest
import yaml

from psrl.config import SandboxPoolConfig, SandboxSpec
from psrl.environments import ENVIRONMENTS, Task
from psrl.environments.swe import (
    BashAction,
    Submit,
    SWETask,
    TaskFormatError,
    builtin_task_ids,
    load_builtin,
    resolve_task,
)
from psrl.environments.swe.env import MiniSWEEnv
from psrl.sandboxes import SandboxPool
from psrl.testing import check_environment

from .solutions import SOLUTIONS

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


def _task(task_id: str) -> Task:
    return Task(prompt=load_builtin(task_id).issue, extra_info={"swe_task": task_id})


async def _episode(env: MiniSWEEnv, task: Task, commands: list[str]) -> tuple[float, dict]:
    try:
        await env.reset(task)
        for cmd in commands:
            _, reward, done, info = await env.step(BashAction(cmd))
            if done:
                return reward, info
        _, reward, done, info = await env.step(Submit())
        assert done
        return reward, info
    finally:
        await env.aclose()


def test_shipped_tasks_load_and_are_registered():
    assert set(builtin_task_ids()) == set(SOLUTIONS)
    assert ENVIRONMENTS.get("mini_swe_env") is MiniSWEEnv
    for task_id in builtin_task_ids():
        task = load_builtin(task_id)
        assert task.tests and task.hidden_tests and not set(task.hidden_tests) & set(task.repo)
        assert task.to_row()["extra_info"] == {"swe_task": task_id}


@pytest.mark.parametrize("task_id", sorted(SOLUTIONS))
async def test_solved_task_gets_reward_1_and_untouched_gets_0(task_id: str):
    reward, info = await _episode(MiniSWEEnv(), _task(task_id), [SOLUTIONS[task_id]])
    assert reward == 1.0, info
    assert info["metrics"]["tests_passed"] == info["metrics"]["tests_total"] == len(load_builtin(task_id).tests)
    assert info["diff"].startswith("--- a/")
    reward, info = await _episode(MiniSWEEnv(), _task(task_id), ["ls"])
    assert reward == 0.0 and info["diff"] == "" and info["grade_error"] is None


async def test_submitting_by_command_ends_the_episode_and_grades():
    env = MiniSWEEnv()
    try:
        await env.reset(_task("text_slugify"))
        await env.step(BashAction(SOLUTIONS["text_slugify"]))
        _, reward, done, info = await env.step("Done.\n```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```")
        assert (reward, done, info["metrics"]["submitted"]) == (1.0, True, 1.0)
        with pytest.raises(RuntimeError, match="episode is over"):
            await env.step(BashAction("ls"))
    finally:
        await env.aclose()


async def test_hidden_tests_never_reach_the_agent_and_cannot_be_replaced():
    task = load_builtin("stats_median")
    [hidden_path] = task.hidden_tests
    env = MiniSWEEnv()
    try:
        await env.reset(_task("stats_median"))
        _, _, _, info = await env.step(BashAction("find /workspace /tmp -name 'test_hidden*'; grep -rl TestMedianHidden /workspace /tmp; echo end"))
        assert info["output"].strip() == "end"
        # The agent plants a passing "hidden" test file and deletes the visible tests.
        fake = "import unittest\nclass TestMedianHidden(unittest.TestCase):\n    def test_even(self): pass\n"
        await env.step(BashAction(f"cat > {hidden_path} <<'EOF'\n{fake}EOF\nrm tests/test_central.py"))
        _, reward, _, info = await env.step(Submit())
    finally:
        await env.aclose()
    assert reward == 0.0  # the real hidden tests ran, over the planted file
    assert "deleted file" not in info["diff"] and "+++ /dev/null" in info["diff"]


async def test_grading_a_hanging_workspace_times_out_with_the_reason():
    calc = resolve_task("calc_divide_by_zero")
    task = {"id": "calc_hang", "issue": calc.issue, "repo": dict(calc.repo), "hidden_tests": dict(calc.hidden_tests),
            "tests": list(calc.tests), "timeout_s": 3}
    env = MiniSWEEnv()
    try:
        await env.reset(Task(prompt="x", extra_info={"swe_task": task}))
        await env.step(BashAction("printf 'def divide(a, b):\\n    while True: pass\\n' >> calc/core.py"))
        _, reward, done, info = await env.step(Submit())
    finally:
        await env.aclose()
    assert done and reward == 0.0
    assert "timed out" in info["grade_error"] and info["metrics"]["grade_errors"] == 1.0


async def test_command_grader_and_command_timeouts():
    task = {
        "id": "touch_file", "issue": "create done.txt", "repo": {"README": "hi\n"},
        "grader": "command", "test_command": "test -f done.txt",
    }
    env = MiniSWEEnv(command_timeout_s=1.0)
    try:
        await env.reset(Task(prompt="x", extra_info={"swe_task": task}))
        obs, _, done, info = await env.step(BashAction("sleep 5"))
        assert not done and info["timed_out"] and info["metrics"]["command_timeouts"] == 1.0
        assert "timed out" in obs.messages[0]["content"]
        obs, _, _, info = await env.step("no command here")
        assert "Format error" in obs.messages[0]["content"] and info["metrics"]["format_errors"] == 1.0
        await env.step(BashAction("touch done.txt"))
        _, reward, done, _ = await env.step(Submit())
    finally:
        await env.aclose()
    assert (reward, done) == (1.0, True)


async def test_passes_the_environment_conformance_checks():
    task = _task("calc_divide_by_zero")
    actions = [BashAction("cat calc/core.py"), BashAction(SOLUTIONS["calc_divide_by_zero"]), Submit()]
    await check_environment(MiniSWEEnv, task, actions, bad_actions=["just text", 12345, BashAction("exit 3")], timeout_s=100)


async def test_sandboxes_go_back_to_the_pool_even_on_early_close():
    spec = SandboxSpec()
    async with SandboxPool(spec, SandboxPoolConfig(warm=1, max_concurrency=2)) as pool:
        env = MiniSWEEnv(sandbox_pool=pool)
        await env.reset(_task("text_slugify"))
        assert pool.statistics().in_use == 1
        await env.aclose()
        assert pool.statistics().in_use == 0
        # A full episode takes a second sandbox for grading only after giving the first back,
        # so even a pool of one cannot deadlock.
        async with SandboxPool(spec, SandboxPoolConfig(warm=0, max_concurrency=1)) as one:
            with anyio.fail_after(30):
                reward, _ = await _episode(MiniSWEEnv(sandbox_pool=one), _task("text_slugify"), [SOLUTIONS["text_slugify"]])
            assert reward == 1.0 and one.statistics().in_use == 0


def test_task_format_errors_name_the_problem(tmp_path):
    base = {"id": "t", "issue": "fix", "repo": {"a.py": "x = 1\n"}, "tests": ["t.T.test"]}
    with pytest.raises(TaskFormatError, match="unknown task fields \\['tset'\\]"):
        SWETask.from_mapping({**base, "tset": 1})
    with pytest.raises(TaskFormatError, match="must be a relative path"):
        SWETask.from_mapping({**base, "repo": {"../evil.py": "x"}})
    with pytest.raises(TaskFormatError, match="needs the 'tests' ids"):
        SWETask.from_mapping({**base, "tests": []})
    with pytest.raises(TaskFormatError, match="neither a shipped task"):
        resolve_task("no_such_task")
    # A task directory: task.yaml + repo/ + hidden/.
    (tmp_path / "repo" / "pkg").mkdir(parents=True)
    (tmp_path / "repo" / "pkg" / "m.py").write_text("x = 1\n")
    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / "test_h.py").write_text("import unittest\n")
    (tmp_path / "task.yaml").write_text(yaml.safe_dump({"id": "dir_task", "issue": "fix", "tests": ["test_h.T.t"]}))
    task = resolve_task(str(tmp_path))
    assert task.repo == {"pkg/m.py": b"x = 1\n"} and set(task.hidden_tests) == {"test_h.py"}
    assert task.to_row()["extra_info"]["swe_task"] == str(tmp_path)
