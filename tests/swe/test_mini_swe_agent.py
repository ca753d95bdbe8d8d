"""The real mini-swe-agent (PyPI) as the black box: its own loop, prompts and litellm model,
pointed at the gateway, with its commands running in our sandbox."""

from __future__ import annotations

import time

import anyio
import numpy as np
import pytest
from transformers import AutoTokenizer

from psrl.agent_loops.base import EpisodeContext
from psrl.agent_loops.mini_swe import MiniSWEAgentLoopV1
from psrl.config import MultiTurnConfig
from psrl.engines import SamplingParams
from psrl.environments.swe import SUBMIT_MARKER
from psrl.environments.swe.agent_data import MiniSWEAgentData
from psrl.environments.swe.agents import mini_swe_agent_installed
from psrl.environments.swe.env import MiniSWEEnv
from psrl.testing import ScriptedEngine
from psrl.trajectory import Status

from ..gateway.helpers import RecordingEngine, reply_ids, tool_call_ids
from .solutions import SOLUTIONS
from .test_loop import _task, assert_trajectory_is_what_the_engine_saw, hf_tokenizer

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not mini_swe_agent_installed(), reason="needs the mini-swe-agent package (pip install 'psrl[swe]')"),
]


def _ctx(engine, tokenizer, *, mode: str, max_turns: int = 8, timeout_s: float = 120.0, max_tokens: int = 400, options=None):
    return EpisodeContext(
        key="swe/0/0", group_id="swe/0", engine=engine, env=MiniSWEEnv(),
        agent_data=MiniSWEAgentData(tokenizer, agent="mini-swe-agent", agent_options={"mode": mode, **(options or {})}),
        sampling=SamplingParams(max_tokens=max_tokens), multi_turn=MultiTurnConfig(max_turns=max_turns, episode_timeout_s=timeout_s),
    )


def _fenced(command: str) -> list[int]:
    return reply_ids(f"THOUGHT: next step.\n\n```mswea_bash_command\n{command}\n```")


@pytest.mark.parametrize("mode", ["toolcall", "textbased"])
async def test_mini_swe_agent_solves_a_task_through_the_gateway(mode: str):
    step = tool_call_ids if mode == "toolcall" else _fenced
    engine = ScriptedEngine([step("cat stats/central.py"), step(SOLUTIONS["stats_median"]), step(f"echo {SUBMIT_MARKER}")])
    traj = await MiniSWEAgentLoopV1().run(_ctx(engine, hf_tokenizer(), mode=mode), _task("stats_median"))
    assert (traj.status, traj.error, traj.reward) == (Status.OK, None, 1.0)
    assert traj.env_metrics["exit_Submitted"] == 1 and traj.env_metrics["commands"] == 3
    assert traj.env_metrics["samples"] == 1  # its history came back as the gateway returned it
    assert_trajectory_is_what_the_engine_saw(traj, engine)


async def test_mini_swe_agent_time_limit_stops_its_thread_and_truncates():
    engine = ScriptedEngine([tool_call_ids("ls")], delay_s=lambda req: 0.0 if len(engine.requests) < 2 else 120.0)
    start = time.monotonic()
    with anyio.fail_after(60):
        traj = await MiniSWEAgentLoopV1().run(_ctx(engine, hf_tokenizer(), mode="toolcall", timeout_s=4.0), _task("text_slugify"))
    assert time.monotonic() - start < 40
    assert traj.status == Status.TRUNCATED and "time limit" in traj.error
    assert engine.statistics().requests_in_flight == 0


async def test_mini_swe_agent_on_vllm_trajectories_hold_exactly_the_engines_ids(vllm_engine, vllm_model_path):
    """A random tiny model writes no valid action: mini-swe-agent answers with format errors and
    quits after three. It drops a badly formatted reply from its history, so each call starts a
    new sample; every sample holds exactly the ids vLLM consumed and produced."""
    engine = RecordingEngine(vllm_engine)
    tokenizer = AutoTokenizer.from_pretrained(vllm_model_path)
    # Its own templates, shortened to fit the test engine's 1024-token context.
    short = {
        "agent_kwargs": {"system_template": "Fix the bug. Reply with one ```mswea_bash_command block.", "instance_template": "{{task}}"},
        "model_config": {"format_error_template": "Format error: {{error}}"},
    }
    ctx = _ctx(engine, tokenizer, mode="textbased", max_tokens=48, options=short)
    samples = await MiniSWEAgentLoopV1().run_all(ctx, _task("calc_divide_by_zero"))
    assert len(engine.calls) == 3 and len(samples) == 3
    for traj in samples:
        assert traj.status == Status.OK, traj.error
        assert traj.env_metrics["exit_RepeatedFormatError"] == 1 and traj.reward == 0.0
        assert traj.env_metrics["samples"] == 3 and traj.num_turns == 1
    by_prompt = {tuple(t.prompt_ids.tolist()): t for t in samples}
    for req, res in engine.calls:
        traj = by_prompt[tuple(req.prompt_ids.tolist())]
        np.testing.assert_array_equal(traj.response_ids, res.output_ids)
        np.testing.assert_array_equal(traj.logprobs, res.logprobs)
        np.testing.assert_array_equal(traj.versions, res.versions)
        assert traj.loss_mask.all()
