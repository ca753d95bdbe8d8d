"""Observation tokens come from templating only the new messages. Where the template renders each
message on its own, the token stream equals templating the whole conversation; where it does not
(reasoning stripped from earlier turns), the stream stays what the model was conditioned on."""

import numpy as np
import pytest

from psrl.environments.chat import ChatTemplateCodec, TemplateError
from psrl.models import model_dir

pytestmark = pytest.mark.timeout(120)

TOOLS = [{"type": "function", "function": {"name": "code_interpreter", "description": "run python",
                                           "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def qwen_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir("tiny-qwen2"))


@pytest.fixture(scope="module")
def smol_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir("smollm2-135m"))


def _model_turn(codec: ChatTemplateCodec, text: str, *, eos: bool = True) -> np.ndarray:
    """What a model emits for ``text``: its tokens, then the end-of-turn token when it stopped there."""
    ids = codec.encode(text)
    return np.concatenate([ids, [codec.tokenizer.eos_token_id]]).astype(np.int32) if eos else ids


def _stream(codec, conversation, tools):
    """prompt + (model turn + delta of the new messages)*: what the agent loop sends the engine."""
    first = 0
    while conversation[first]["role"] != "assistant":
        first += 1
    parts = [codec.prompt_ids(conversation[:first], tools=tools)]
    i = first
    while i < len(conversation):
        out = _model_turn(codec, conversation[i]["content"])
        parts.append(out)
        j = i + 1
        while j < len(conversation) and conversation[j]["role"] != "assistant":
            j += 1
        if j > i + 1:
            parts.append(codec.new_message_ids(conversation[i + 1 : j], last_output_ids=out, tools=tools))
        i = j
    return np.concatenate(parts)


CONVERSATION = [
    {"role": "system", "content": "You are a careful solver."},
    {"role": "user", "content": "What is 17 * 23?"},
    {"role": "assistant", "content": 'Let me run it. <tool_call>{"name": "code_interpreter", "arguments": {"code": "print(17*23)"}}</tool_call>'},
    {"role": "tool", "content": "391"},
    {"role": "assistant", "content": "Check twice. <tool_call>{\"name\": \"code_interpreter\", \"arguments\": {\"code\": \"print(391)\"}}</tool_call>"},
    {"role": "tool", "content": "391"},
    {"role": "user", "content": "Sure?"},
    {"role": "assistant", "content": "The answer is \\boxed{391}."},
]


@pytest.mark.parametrize("tools", [TOOLS, None])
def test_qwen_style_template_deltas_equal_whole_conversation(qwen_tok, tools):
    codec = ChatTemplateCodec(qwen_tok)
    stream = _stream(codec, CONVERSATION, tools)
    whole = codec.encode(codec.render(CONVERSATION, tools=tools, add_generation_prompt=False))
    # The whole render ends the last assistant turn with "<|im_end|>\n"; the model stops at <|im_end|>.
    np.testing.assert_array_equal(stream, whole[:-1])
    assert codec.decode(whole[-1:], skip_special_tokens=False) == "\n"


def test_smollm2_template_deltas_equal_whole_conversation(smol_tok):
    codec = ChatTemplateCodec(smol_tok)
    assert not codec.shows_tools()  # SmolLM2's template ignores `tools`
    stream = _stream(codec, CONVERSATION, None)
    whole = codec.encode(codec.render(CONVERSATION, add_generation_prompt=False))
    np.testing.assert_array_equal(stream, whole[:-1])


def test_delta_holds_only_the_new_messages_and_closes_the_turn(qwen_tok):
    codec = ChatTemplateCodec(qwen_tok)
    out = _model_turn(codec, "hi")
    delta = codec.new_message_ids([{"role": "tool", "content": "42"}], last_output_ids=out)
    assert codec.decode(delta, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # A turn cut by the length limit has no <|im_end|>: the codec supplies the whole terminator.
    cut = codec.new_message_ids([{"role": "tool", "content": "42"}], last_output_ids=_model_turn(codec, "hi", eos=False))
    assert codec.decode(cut, skip_special_tokens=False).startswith("<|im_end|>\n<|im_start|>user\n")


# A Qwen3-like template: reasoning (<think>...</think>) of assistant turns before the last user
# message is dropped when the conversation is rendered again.
STRIP_REASONING = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}{% set c = m.content %}"
    "{% if loop.index0 < ns.last_user and '</think>' in c %}{% set c = c.split('</think>')[-1].lstrip() %}{% endif %}"
    "<|im_start|>assistant\n{{ c }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_reasoning_stripping_template_keeps_what_the_model_saw(qwen_tok):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir("tiny-qwen2"))
    tok.chat_template = STRIP_REASONING
    codec = ChatTemplateCodec(tok)
    conversation = [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "<think>two plus three</think> It is 5."},
        {"role": "user", "content": "And times 4?"},
        {"role": "assistant", "content": "<think>five times four</think> It is 20."},
    ]
    stream = _stream(codec, conversation, None)
    whole = codec.encode(codec.render(conversation, add_generation_prompt=False))
    text = codec.decode(stream, skip_special_tokens=False)
    # Re-templating the whole conversation would erase the first turn's reasoning ...
    assert "two plus three" not in codec.decode(whole, skip_special_tokens=False)
    assert len(stream) != len(whole) - 1
    # ... while the loop's stream holds every token the model generated, in order, never re-rendered.
    assert "<think>two plus three</think> It is 5.<|im_end|>\n<|im_start|>user\nAnd times 4?" in text
    first_turn = _model_turn(codec, conversation[1]["content"])
    prompt = codec.prompt_ids(conversation[:1])
    np.testing.assert_array_equal(stream[len(prompt) : len(prompt) + len(first_turn)], first_turn)


def test_template_that_rerenders_history_is_refused_with_a_clear_error(qwen_tok):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir("tiny-qwen2"))
    # Announces the number of messages up front: any new message changes earlier text.
    tok.chat_template = "[{{ messages | length }} messages]{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    codec = ChatTemplateCodec(tok)
    with pytest.raises(TemplateError, match="renders earlier messages differently"):
        codec.new_message_ids([{"role": "user", "content": "x"}], last_output_ids=np.zeros(0, np.int32))


def test_tokenizer_without_template_is_refused(qwen_tok):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir("tiny-qwen2"))
    tok.chat_template = None
    with pytest.raises(TemplateError, match="no chat template"):
        ChatTemplateCodec(tok)
