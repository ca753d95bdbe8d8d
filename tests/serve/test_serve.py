"""``psrl serve``: admin API, sessions used by the openai client, trajectories of each closed
session in parquet; in-process with the scripted engine (the vLLM run is marked slow)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx
import numpy as np
import openai
import pyarrow.parquet as pq
import pytest

from psrl.config import load_config
from psrl.serve import ServeInfo, serve
from psrl.testing import ScriptedEngine

from ..gateway.helpers import chat_tokenizer, reply_ids

pytestmark = [pytest.mark.timeout(60)]
ROOT = Path(__file__).resolve().parents[2]


def _cfg(tmp_path: Path, *overrides: str):
    return load_config(None, [f"logging.output_dir={tmp_path}", *overrides])


@pytest.mark.anyio
async def test_serve_opens_sessions_over_http_and_writes_each_closed_one(tmp_path):
    engine = ScriptedEngine(lambda req: reply_ids("Hi!"))
    ready: list[ServeInfo] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: serve(_cfg(tmp_path, "gateway.model_aliases=[gpt-4o]"), engine=engine, tokenizer=chat_tokenizer().hf, on_ready=ready.append))
        with anyio.fail_after(20):
            while not ready:
                await anyio.sleep(0.05)
        info = ready[0]
        admin = {"Authorization": f"Bearer {info.admin_token}"}
        async with httpx.AsyncClient(base_url=info.url) as http:
            r = await http.post("/sessions", json={})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            r = await http.post("/sessions", json={"session_id": "task-7", "max_calls": 5, "sampling": {"temperature": 0.0}}, headers=admin)
            assert r.status_code == 201
            opened = r.json()
            assert opened["session_id"] == "task-7" and opened["base_url"] == f"{info.url}/sessions/task-7/v1"
            r = await http.post("/sessions", json={"session_id": "task-7"}, headers=admin)
            assert r.status_code == 409
            r = await http.post("/sessions", json={"max_calls": 0}, headers=admin)
            assert r.status_code == 400 and "max_calls" in r.json()["error"]["message"]
            other = (await http.post("/sessions", json={}, headers=admin)).json()  # left open: written at stop

            async with openai.AsyncOpenAI(base_url=opened["base_url"], api_key=opened["token"], max_retries=0) as client:
                messages = [{"role": "user", "content": "hello"}]
                for turn in range(2):
                    c = await client.chat.completions.create(model="gpt-4o", messages=messages)
                    messages += [c.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"more {turn}"}]
                with pytest.raises(openai.NotFoundError):
                    await client.chat.completions.create(model="other", messages=messages)
            async with openai.AsyncOpenAI(base_url=other["base_url"], api_key=other["token"], max_retries=0) as client:
                await client.completions.create(model="psrl-policy", prompt="once", max_tokens=4)

            r = await http.delete("/sessions/task-7", headers=admin)
            assert r.status_code == 200
            assert r.json() == {"session_id": "task-7", "calls": 2, "failed_calls": 0, "tool_call_errors": 0, "closed_reason": "closed"}
            assert (await http.delete("/sessions/nope", headers=admin)).status_code == 404
            assert (await http.delete("/sessions/task-7")).status_code == 401
        table = pq.read_table(info.sessions_dir / "task-7.parquet")
        assert table.num_rows == 1  # two calls, one continued the other: one trajectory
        row = table.to_pylist()[0]
        assert row["key"] == "task-7" and len(row["turn_bounds"]) == 2 * 2
        np.testing.assert_array_equal(row["prompt_ids"], engine.requests[0].prompt_ids)
        assert engine.requests[0].sampling.temperature == 0.0  # the session's sampling
        tg.cancel_scope.cancel()
    table = pq.read_table(info.sessions_dir / f"{other['session_id']}.parquet")  # closed at stop, written
    assert table.num_rows == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_psrl_serve_command_with_vllm_and_the_openai_client(tmp_path):
    """The command as a user runs it: the base URL and admin token on stdout, vLLM behind it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, "-m", "psrl.cli", "serve", "recipes/quickstart/config.yaml", "--port", "0", f"logging.output_dir={tmp_path}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = token = None
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and token is None:
            line = proc.stdout.readline()
            if line.startswith("psrl serve: listening on "):
                url = line.split()[-1]
            elif "admin token:" in line:
                token = line.split()[-1]
            assert line or proc.poll() is None, proc.stderr.read()
        admin = {"Authorization": f"Bearer {token}"}
        opened = httpx.post(f"{url}/sessions", json={"sampling": {"max_tokens": 8}}, headers=admin).json()
        client = openai.OpenAI(base_url=opened["base_url"], api_key=opened["token"], max_retries=0)
        r = client.chat.completions.create(model="psrl-policy", messages=[{"role": "user", "content": "2+2?"}], logprobs=True)
        assert r.usage.completion_tokens == len(r.choices[0].logprobs.content) > 0
        assert httpx.delete(f"{url}/sessions/{opened['session_id']}", headers=admin).json()["calls"] == 1
        assert pq.read_table(tmp_path / "sessions" / f"{opened['session_id']}.parquet").num_rows == 1
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "INFO" not in err, err  # quiet: vLLM's log lines went to the log files
    assert (tmp_path / "logs" / "vllm.log").stat().st_size > 0
