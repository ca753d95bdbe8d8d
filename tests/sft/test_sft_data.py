"""SFT rendering and masks with the real SmolLM2 tokenizer (the ReTool recipe's model)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from psrl.environments.tool.python_tool import PYTHON_SCHEMA
from psrl.sft.data import SFTDataError, load_samples, plan_batches, render_messages
from psrl.sft.stats import trajectory_stats
from psrl.trajectory import Trajectory, to_arrow

pytestmark = pytest.mark.timeout(120)

CALL = {"type": "function", "function": {"name": "code_interpreter", "arguments": json.dumps({"code": "print(6 * 7)"})}}
CONVO = [
    {"role": "user", "content": "What is 6 * 7?"},
    {"role": "assistant", "content": "Let me run it.", "tool_calls": [CALL]},
    {"role": "tool", "content": "42", "name": "code_interpreter"},
    {"role": "assistant", "content": "It is \\boxed{42}."},
]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from psrl.models import model_dir

    return AutoTokenizer.from_pretrained(model_dir("smollm2-135m"))


def _segments(ids: np.ndarray, mask: np.ndarray) -> list[tuple[int, np.ndarray]]:
    cuts = np.flatnonzero(np.diff(mask)) + 1
    return [(int(m[0]), seg) for seg, m in zip(np.split(ids, cuts), np.split(mask, cuts))]


def test_assistant_turns_alone_carry_loss(tok):
    prompt, response, mask = render_messages(tok, CONVO, [PYTHON_SCHEMA])
    assert len(response) == len(mask)
    prompt_text = tok.decode(prompt.tolist(), skip_special_tokens=False)
    assert "code_interpreter" in prompt_text and "What is 6 * 7?" in prompt_text  # tools described (SmolLM2 shows none)
    assert prompt_text.endswith("<|im_start|>assistant\n")
    segs = _segments(response, mask)
    assert [m for m, _ in segs] == [1, 0, 1]
    turn1, obs, turn2 = (tok.decode(s.tolist(), skip_special_tokens=False) for _, s in segs)
    assert turn1 == 'Let me run it.\n<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(6 * 7)"}}</tool_call><|im_end|>'
    assert obs.startswith("\n<|im_start|>tool") and "42" in obs and obs.endswith("<|im_start|>assistant\n")
    assert turn2 == "It is \\boxed{42}.<|im_end|>"
    # Token for token what templating the whole conversation gives (SmolLM2 renders turns independently).
    whole = tok.apply_chat_template(
        [{"role": "system", "content": prompt_text.split("<|im_start|>system\n", 1)[1].split("<|im_end|>", 1)[0]},
         CONVO[0], {"role": "assistant", "content": turn1.removesuffix("<|im_end|>")}, CONVO[2], CONVO[3]],
        tokenize=False,
    )
    assert tok.decode(np.concatenate([prompt, response]).tolist(), skip_special_tokens=False) == whole.rstrip("\n")


def test_bad_rows_are_named(tok, tmp_path):
    with pytest.raises(SFTDataError, match="no assistant message"):
        render_messages(tok, CONVO[:1])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}) + "\n")
    with pytest.raises(SFTDataError, match=r"bad.jsonl row 0: the first message is the assistant's"):
        load_samples([str(bad)], tok)
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(SFTDataError, match="neither a 'messages' column"):
        load_samples([str(other)], tok)


def _traj(key: str, reward: float, mask: list[int], metrics: dict[str, float]) -> Trajectory:
    n = len(mask)
    return Trajectory(
        key=key, group_id=key, prompt_ids=np.array([1, 2, 3], np.int32), response_ids=np.arange(10, 10 + n, dtype=np.int32),
        loss_mask=np.array(mask, np.int8), logprobs=np.zeros(n, np.float32), versions=np.zeros(n, np.int32),
        turn_bounds=np.array([[0, n]], np.int32), turn_rewards=np.zeros(1, np.float32), reward=reward, env_metrics=metrics,
    )


def test_trajectories_keep_their_mask_filter_cut_and_stats(tok, tmp_path):
    f = tmp_path / "t.parquet"
    trajs = [
        _traj("a", 1.0, [1, 1, 0, 0, 1], {"tool_calls": 1.0, "tool_errors": 0.0}),
        _traj("b", 0.0, [1, 1, 1], {"tool_calls": 2.0, "tool_errors": 1.0}),
        _traj("c", 1.0, [0, 0, 0, 1, 1, 1, 1], {}),
    ]
    pq.write_table(pa.Table.from_batches([to_arrow(trajs)]), f)
    samples, counts = load_samples([str(f)], tok, min_reward=0.5, max_length=8)
    assert [s.key.rsplit("#")[1] for s in samples] == ["0", "2"]
    assert samples[0].loss_mask.tolist() == [1, 1, 0, 0, 1]
    assert samples[1].loss_mask.tolist() == [0, 0, 0, 1, 1]  # cut to 8 tokens with its 3 prompt tokens
    assert counts == {"rows": 2, "cut": 1, "skipped": 0}
    s = trajectory_stats(f)
    assert s["episodes"] == 3 and s["accuracy"] == pytest.approx(2 / 3)
    assert s["well_formed_rate"] == pytest.approx(1 / 3) and s["called_tool_rate"] == pytest.approx(2 / 3)
    assert s["call_error_rate"] == pytest.approx(1 / 3)


def test_batches_by_sequences_or_tokens(tok, tmp_path):
    f = tmp_path / "m.jsonl"
    f.write_text("".join(json.dumps({"messages": CONVO, "tools": [PYTHON_SCHEMA]}) + "\n" for _ in range(5)))
    samples, _ = load_samples([str(f)], tok)
    steps = plan_batches(samples, batch_size=2, batch_tokens=None, epochs=2, shuffle=True, seed=0)
    assert [len(s) for s in steps] == [2, 2, 1, 2, 2, 1]
    assert sorted(i for s in steps[:3] for i in s) == list(range(5))
    by_tokens = plan_batches(samples, batch_size=1, batch_tokens=2 * samples[0].seq_len, epochs=1, shuffle=False, seed=0)
    assert by_tokens == [[0, 1], [2, 3], [4]]
