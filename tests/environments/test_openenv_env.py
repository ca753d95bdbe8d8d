"""``openenv_env`` against real OpenEnv servers: the echo environment of openenv-core's own
``openenv init`` template, served by openenv-core's ``create_app`` under uvicorn on 127.0.0.1."""

from __future__ import annotations

import shutil
from pathlib import Path

import anyio
import pyarrow.parquet as pq
import pytest

pytest.importorskip("openenv.core", reason="needs the envs extra (openenv-core)")

from psrl.environments import Task  # noqa: E402
from psrl.environments.dataset import write_rows  # noqa: E402
from psrl.environments.openenv_env.env import OpenEnvEnv  # noqa: E402
from psrl.pipeline.rollout import rollout  # noqa: E402
from psrl.testing import ScriptedEngine  # noqa: E402
from psrl.trajectory import Status, from_arrow  # noqa: E402

from .adapters_common import reply, rollout_config, tiny_tokenizer  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


@pytest.fixture
def anyio_backend():
    return "asyncio"  # openenv-core's client is asyncio-only


@pytest.fixture(scope="module")
def echo_app(tmp_path_factory) -> tuple[str, str]:
    """The package's environment template rendered as `echo_env` (what `openenv init echo_env`
    writes, minus its slow dependency locking)."""
    import openenv.cli

    template = Path(openenv.cli.__file__).parent / "templates" / "openenv_env"
    root = tmp_path_factory.mktemp("openenv")
    target = root / "echo_env"
    shutil.copytree(template, target, ignore=shutil.ignore_patterns("__pycache__"))
    for path in list(target.rglob("*")):
        if path.is_file():
            text = path.read_text().replace("__ENV_CLASS_NAME__", "EchoEnv").replace("__ENV_TITLE_NAME__", "Echo Env").replace("__ENV_NAME__", "echo_env")
            new = path.with_name(path.name.replace("__ENV_NAME__", "echo_env"))
            path.unlink()
            new.write_text(text)
    return "echo_env.server.app:app", str(root)


@pytest.fixture(scope="module")
def echo_url(echo_app):
    """One server for the module, started as a user would: uvicorn on 127.0.0.1."""
    import socket
    import subprocess
    import sys
    import time

    app, app_dir = echo_app
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", app, "--app-dir", app_dir, "--host", "127.0.0.1", "--port", str(port)], cwd=app_dir)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the OpenEnv server did not start"
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def test_episode_against_a_server_started_per_episode(echo_app):
    app, app_dir = echo_app
    env = OpenEnvEnv(app=app, app_dir=app_dir, observation_field="echoed_message")
    try:
        obs, _ = await env.reset(Task(prompt="Say something."))
        assert obs.messages == [{"role": "user", "content": "Say something.\n\nEcho Env environment ready!"}]
        obs, reward, done, info = await env.step("hello")
        assert obs.messages[0]["content"] == "hello" and reward == pytest.approx(0.5) and done is False
    finally:
        await env.aclose()
    port = int(env.url.rsplit(":", 1)[1])
    with pytest.raises(OSError):  # the episode's server is gone
        await anyio.connect_tcp("127.0.0.1", port)


async def test_given_url_rejected_and_malformed_actions_become_observations(echo_url):
    url = echo_url
    env = OpenEnvEnv(base_url=url, action_field="not_a_field")
    try:
        await env.reset(Task(prompt="p"))
        obs, reward, done, info = await env.step("hi")
        assert "rejected" in obs.messages[0]["content"] and info["metrics"]["format_errors"] == 1.0 and not done
    finally:
        await env.aclose()
    env = OpenEnvEnv(base_url=url, action_format="json", observation_field="message_length")
    try:
        await env.reset(Task(prompt="p"))
        obs, _, _, info = await env.step("no json here")
        assert info["metrics"]["format_errors"] == 1.0
        obs, reward, _, _ = await env.step('sure: {"message": "abcd"}')
        assert obs.messages[0]["content"] == "4" and reward == pytest.approx(0.4)
    finally:
        await env.aclose()


async def test_episode_through_psrl_rollout(tmp_path, echo_url):
    tokenizer = tiny_tokenizer()
    rows = [{
        "prompt": "Echo a word.", "env_class": "openenv_env",
        "env_kwargs": {"base_url": echo_url, "observation_field": "echoed_message"},
    }]  # fmt: skip
    data = write_rows(tmp_path / "rows.jsonl", rows)
    cfg = rollout_config(tmp_path, data, n=1, max_turns=2)  # the template server allows one session at a time
    out = tmp_path / "out.parquet"
    engine = ScriptedEngine(lambda req: reply(tokenizer, "abc"))
    summary = await rollout(cfg, str(out), engine=engine, tokenizer=tokenizer)
    trajs = from_arrow(pq.read_table(out))
    assert summary.episodes == 1 and len(trajs) == 1
    for t in trajs:
        assert t.status is Status.TRUNCATED and t.num_turns == 2, t.error  # the echo env never ends
        assert t.turn_rewards.tolist() == pytest.approx([0.3, 0.3])
        start, end = t.turn_bounds[1]
        assert t.response_ids[start:end].tolist() == reply(tokenizer, "abc")
        # the observation the model saw after turn 1 is the server's echo, in the chat template
        obs_text = tokenizer.decode(t.response_ids[t.turn_bounds[0][1]:start].tolist())
        assert "abc" in obs_text and "user" in obs_text
