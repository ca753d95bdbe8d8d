"""Token capture: merging calls by token prefix, and chat prompts that reuse earlier ids."""

from __future__ import annotations

import numpy as np
import pytest

from psrl.engines import FinishReason
from psrl.gateway import CapturedCall, PromptBuilder, SessionCapture, merge_calls
from psrl.trajectory import NO_VERSION, Status

from .helpers import chat_tokenizer, reply_ids

pytestmark = pytest.mark.timeout(60)


def _call(i: int, prompt, output, version: int = 3) -> CapturedCall:
    out = np.asarray(output, np.int32)
    return CapturedCall(
        index=i, request_id=f"r{i}", endpoint="chat", prompt_ids=np.asarray(prompt, np.int32), output_ids=out,
        logprobs=np.linspace(-1, -0.1, len(out)).astype(np.float32), versions=np.full(len(out), version, np.int32),
        finish_reason=FinishReason.STOP, latency_s=0.0,
    )


def test_continuing_calls_make_one_sample_with_observation_tokens_masked():
    cap = SessionCapture("s")
    cap.record(_call(0, [1, 2, 3], [10, 11], version=1))
    cap.record(_call(1, [1, 2, 3, 10, 11, 20, 21, 22], [12], version=2))
    cap.record(_call(2, [1, 2, 3, 10, 11, 20, 21, 22, 12, 30], [13, 14], version=2))
    [t] = cap.trajectories("ep", "g", reward=0.5)
    np.testing.assert_array_equal(t.prompt_ids, [1, 2, 3])
    np.testing.assert_array_equal(t.response_ids, [10, 11, 20, 21, 22, 12, 30, 13, 14])
    np.testing.assert_array_equal(t.loss_mask, [1, 1, 0, 0, 0, 1, 0, 1, 1])
    np.testing.assert_array_equal(t.versions, [1, 1, NO_VERSION, NO_VERSION, NO_VERSION, 2, NO_VERSION, 2, 2])
    np.testing.assert_array_equal(t.turn_bounds, [[0, 2], [5, 6], [7, 9]])
    assert t.logprobs[2] == 0 and t.logprobs[0] == pytest.approx(-1.0)
    assert t.key == "ep" and t.reward == 0.5 and t.status is Status.OK
    t.validate()


def test_divergence_starts_a_new_sample_and_threads_merge_separately():
    calls = [
        _call(0, [1, 2], [5]),
        _call(1, [7, 8], [9]),  # another thread
        _call(2, [1, 2, 5, 6], [4]),  # continues the first
        _call(3, [7, 8, 9, 1], [2]),  # continues the second
        _call(4, [1, 2, 99], [3]),  # edits history: a new sample
    ]
    samples = merge_calls(calls)
    assert [s.calls for s in samples] == [[0, 2], [1, 3], [4]]
    cap = SessionCapture("s")
    for c in calls:
        cap.record(c)
    keys = [t.key for t in cap.trajectories("ep")]
    assert keys == ["ep", "ep/1", "ep/2"]


def test_chat_continuation_reuses_the_models_own_ids_not_a_retokenization():
    tok = chat_tokenizer()
    builder = PromptBuilder(tok)
    messages = [{"role": "user", "content": "hi"}]
    first = builder.build_chat(messages, None)
    assert not first.reused
    # The model spells "hello" one character at a time: a valid but non-canonical tokenization.
    spelled = np.concatenate([tok.encode(c) for c in "hello"] + [np.array(sorted(tok.eos_ids)[:1], np.int32)])
    assert not np.array_equal(spelled[:-1], tok.encode("hello"))
    builder.remember_chat(messages, None, first, spelled, {"role": "assistant", "content": "hello"})
    nxt = messages + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    second = builder.build_chat(nxt, None)
    assert second.reused
    n = len(first.ids) + len(spelled)
    np.testing.assert_array_equal(second.ids[:n], np.concatenate([first.ids, spelled]))
    # The tail is the template's text after the assistant turn, and the whole decodes to the full render.
    assert tok.decode(second.ids, skip_special=False) == tok.render(nxt, None, generation=True)


def test_edited_history_or_other_tools_are_tokenized_afresh():
    tok = chat_tokenizer()
    builder = PromptBuilder(tok)
    messages = [{"role": "user", "content": "hi"}]
    first = builder.build_chat(messages, None)
    out = np.asarray(tok.encode("ok").tolist() + sorted(tok.eos_ids)[:1], np.int32)
    builder.remember_chat(messages, None, first, out, {"role": "assistant", "content": "ok"})
    edited = messages + [{"role": "assistant", "content": "OK!"}, {"role": "user", "content": "x"}]
    assert not builder.build_chat(edited, None).reused
    same = messages + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "x"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert not builder.build_chat(same, tools).reused
    assert builder.build_chat(same, None).reused


def test_a_turn_cut_off_before_its_end_token_gets_the_end_token_from_the_template():
    tok = chat_tokenizer()
    builder = PromptBuilder(tok)
    messages = [{"role": "user", "content": "hi"}]
    first = builder.build_chat(messages, None)
    out = tok.encode("partial answ")  # finish_reason length: no end-of-turn token
    builder.remember_chat(messages, None, first, out, {"role": "assistant", "content": "partial answ"})
    nxt = messages + [{"role": "assistant", "content": "partial answ"}, {"role": "user", "content": "go on"}]
    second = builder.build_chat(nxt, None)
    assert second.reused
    tail = second.ids[len(first.ids) + len(out):]
    assert tok.decode(tail, skip_special=False).startswith(tok.eos_text)


def test_raw_completions_continue_on_text_prefix():
    tok = chat_tokenizer()
    builder = PromptBuilder(tok)
    first = builder.build_text("def f(x):")
    out = np.asarray(reply_ids("\n    return", eos=False), np.int32)
    builder.remember_text(first, out, tok.decode(out))
    second = builder.build_text("def f(x):" + tok.decode(out) + " x + 1")
    assert second.reused
    np.testing.assert_array_equal(second.ids[: len(first.ids) + len(out)], np.concatenate([first.ids, out]))
