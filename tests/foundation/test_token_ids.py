"""``TokenIds`` calls the Rust tokenizer directly (no rayon hop, no wrapper) on every turn of the
agent loops and the gateway: it must give the HF wrapper's ids and text exactly, special tokens,
odd whitespace and long texts (the GIL-releasing batch calls) included; a setting the wrapper acts
on turns the direct path off."""

from __future__ import annotations

import pytest

from psrl.environments.chat import ChatTemplateCodec
from psrl.gateway import ChatTokenizer
from psrl.token_ids import HOLD_GIL_BELOW, TokenIds


@pytest.fixture(scope="module", params=["tiny-qwen2", "smollm2-135m"])
def hf(request):
    from transformers import AutoTokenizer

    from psrl.models import model_dir

    return AutoTokenizer.from_pretrained(str(model_dir(request.param)))


def test_direct_calls_equal_the_hf_wrapper(hf):
    ids_of = TokenIds(hf)
    assert ids_of.direct is not None
    long = " ".join(f"w{i} {hf.eos_token}" for i in range(600))
    assert len(long) >= HOLD_GIL_BELOW
    texts = [
        "plain words", "  leading and trailing  ", "tabs\tand\nnewlines\n\n", "caf\u00e9 \u4e2d\u6587 \U0001f600",
        hf.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True),
        f"x{hf.eos_token}y{hf.eos_token}", "def f(x):\n    return {'a': [1, 2]}  # ok", "", long,
    ]
    for text in texts:
        ids = ids_of.encode(text)
        assert ids.tolist() == hf.encode(text, add_special_tokens=False), text[:40]
        for skip in (True, False):
            assert ids_of.decode(ids, skip_special_tokens=skip) == hf.decode(ids.tolist(), skip_special_tokens=skip), text[:40]


def test_the_gateway_and_the_agent_loops_take_the_direct_path(hf):
    assert ChatTokenizer(hf).ids.direct is not None
    assert ChatTemplateCodec(hf).ids.direct is not None


def test_a_setting_the_wrapper_acts_on_turns_it_off():
    from transformers import AutoTokenizer

    from psrl.models import model_dir

    tok = AutoTokenizer.from_pretrained(str(model_dir("tiny-qwen2")))
    tok.clean_up_tokenization_spaces = True  # decode would then post-process the text
    assert TokenIds(tok).direct is None
    assert TokenIds(tok).decode([5, 6]) == tok.decode([5, 6])
