"""tool_env on real bubblewrap sandboxes: the model's Python runs in its episode's sandbox with
time and output limits; tool calls of a turn run concurrently; bad calls become observations."""

from __future__ import annotations

import anyio
import pytest

from psrl.agent_loops.tool_parsers import HermesToolParser
from psrl.config import SandboxPoolConfig, SandboxSpec
from psrl.environments import ENVIRONMENTS, Task
from psrl.environments.chat import ChatObservation
from psrl.environments.tool.env import ToolEnv
from psrl.environments.tools import ToolAction, ToolCall, ToolResult, run_tool_calls
from psrl.sandboxes import SandboxPool
from psrl.testing import check_environment

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

PARSE = HermesToolParser().parse
TASK = Task(prompt=[{"role": "user", "content": "What is 6*7?"}], ground_truth="42")


def call(code: str) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": "code_interpreter", "arguments": {"code": code}}) + "</tool_call>"


@pytest.fixture
async def pool(tmp_path):
    async with SandboxPool(SandboxSpec(state_dir=str(tmp_path / "sb")), SandboxPoolConfig(warm=0, max_concurrency=8)) as p:
        yield p
    assert not list((tmp_path / "sb").glob("sb-*")), "a sandbox dir outlived the pool"


class Rendezvous:
    """Two of these only finish when both run at once: a sequential runner would deadlock."""

    def __init__(self, name: str, mine: anyio.Event, other: anyio.Event) -> None:
        self.name, self.mine, self.other = name, mine, other
        self.schema = {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}

    async def call(self, arguments):
        self.mine.set()
        await self.other.wait()
        return ToolResult(f"{self.name} met", {"met": 1.0})


async def test_calls_of_one_turn_run_concurrently():
    a, b = anyio.Event(), anyio.Event()
    tools = {"left": Rendezvous("left", a, b), "right": Rendezvous("right", b, a)}
    action = ToolAction("", "", calls=[ToolCall("left", {}, "c0"), ToolCall("right", {}, "c1")])
    with anyio.fail_after(5):
        messages, metrics = await run_tool_calls(tools, action)
    assert [m["content"] for m in messages] == ["left met", "right met"]
    assert metrics == {"tool_calls": 2.0, "tool_errors": 0.0, "met": 2.0}


async def test_python_runs_in_the_sandbox_with_limits(pool):
    env = ToolEnv(sandbox_pool=pool, timeout_s=1.0, max_output_chars=200, max_calls_per_turn=6)
    obs, _ = await env.reset(TASK)
    assert obs.tools[0]["function"]["name"] == "code_interpreter"
    text = (
        "Let me check. "
        + call("import os\nprint(6*7, os.getcwd())")
        + call("while True: pass")
        + call("print('x' * 100000)")
        + call("raise ValueError('boom')")
        + '<tool_call>{"name": "browser", "arguments": {}}</tool_call>'
        + call("print(input())")
        + call("print('one too many')")
        + "<tool_call>{oops}</tool_call>"
    )
    obs, reward, done, info = await env.step(PARSE(text))
    assert (reward, done) == (0.0, False)
    out = [m["content"] for m in obs.messages]
    assert out[0] == "42 /workspace"
    assert "timed out after 1 s" in out[1]
    assert len(out[2]) < 300 and "characters cut" in out[2]
    assert "ValueError: boom" in out[3]
    assert "unknown tool 'browser'" in out[4] and "code_interpreter" in out[4]
    assert "EOFError" in out[5]  # stdin is the code itself: input() cannot hang
    assert "at most 6 tool calls per turn" in out[6]
    assert "could not parse tool call" in out[7]
    m = info["metrics"]
    assert m["tool_calls"] == 8 and m["tool_errors"] == 3 and m["unknown_tool"] == 1 and m["malformed_calls"] == 1
    assert m["tool_timeouts"] == 1 and m["tool_exec_errors"] == 3 and m["tool_output_truncated"] == 1  # 100 kB of stdout: killed at the limit
    assert pool.statistics().in_use == 1

    obs, reward, done, info = await env.step(PARSE("So 6*7 = \\boxed{42}."))
    assert (reward, done, obs.messages) == (1.0, True, [])
    await env.aclose()
    assert pool.statistics().in_use == 0


async def test_each_episode_has_its_own_sandbox(pool):
    a, b = ToolEnv(sandbox_pool=pool), ToolEnv(sandbox_pool=pool)
    try:
        await a.reset(TASK)
        await b.reset(TASK)
        await a.step(PARSE(call("open('/workspace/mine.txt', 'w').write('secret')")))
        obs, *_ = await b.step(PARSE(call("import os\nprint(os.path.exists('/workspace/mine.txt'))")))
        assert obs.messages[0]["content"] == "False"
        obs, *_ = await a.step(PARSE(call("print(open('/workspace/mine.txt').read())")))
        assert obs.messages[0]["content"] == "secret"
        assert pool.statistics().in_use == 2
    finally:
        await a.aclose()
        await b.aclose()
    assert pool.statistics().in_use == 0


async def test_episode_without_tool_calls_takes_no_sandbox(pool):
    env = ToolEnv(sandbox_pool=pool)
    await env.reset(TASK)
    _, reward, done, _ = await env.step(PARSE("\\boxed{41}"))
    assert (reward, done) == (0.0, True)
    await env.aclose()
    assert pool.statistics().created == 0


async def test_without_a_pool_a_tool_call_is_an_env_failure():
    env = ToolEnv()
    await env.reset(TASK)
    with pytest.raises(RuntimeError, match="no sandbox pool"):
        await env.step(PARSE(call("print(1)")))
    await env.aclose()


async def test_tool_env_passes_check_environment(pool):
    assert ENVIRONMENTS.get("tool_env") is ToolEnv
    actions = [PARSE(call("print(sum(range(10)))")), PARSE("\\boxed{45}")]
    bad = ["plain text answer", PARSE("<tool_call>{broken</tool_call>"), PARSE(call(""))]
    await check_environment(lambda: ToolEnv(sandbox_pool=pool), Task(prompt="sum 0..9", ground_truth=45), actions, bad_actions=bad)
    assert pool.statistics().in_use == 0


def test_observations_are_chat_messages():
    obs = ChatObservation(messages=[{"role": "tool", "content": "1"}])
    assert obs.tools is None and obs.messages[0]["role"] == "tool"
