"""Tool-call parsers of every family under one contract: good calls read, a malformed call
becomes a ToolCallError (never plain content, never an exception), one bad call keeps the good."""

from functools import cache

import pytest

from psrl.agent_loops import TOOL_PARSERS
from psrl.agent_loops.registry import VLLM_FAMILIES
from psrl.agent_loops.tool_parsers import HarmonyToolParser, HermesToolParser, ToolParser, make_tool_parser
from psrl.environments.tools import ToolCall

pytestmark = pytest.mark.timeout(120)

# Marker tokens of the families below: vLLM's parsers look them up in the tokenizer, and no
# family's own tokenizer is on this offline machine, so the tiny model's gets them added.
MARKER_TOKENS = [
    "<|python_tag|>", "[TOOL_CALLS]", "<|tool_call|>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_end|>",
    "<|tool_call_argument_begin|>",
]  # fmt: skip


@cache
def _tokenizer():
    from transformers import AutoTokenizer

    from psrl.models import model_dir

    tok = AutoTokenizer.from_pretrained(str(model_dir("tiny-qwen2")))
    tok.add_special_tokens({"additional_special_tokens": MARKER_TOKENS})
    return tok


def test_registered_names():
    assert TOOL_PARSERS.get("hermes") is HermesToolParser is TOOL_PARSERS.get("qwen") is TOOL_PARSERS.get("qwen3_json")
    assert TOOL_PARSERS.get("openai") is HarmonyToolParser
    assert isinstance(HermesToolParser(), ToolParser)
    for name in ("llama3_json", "mistral", "pythonic", "qwen3_coder", "deepseek_v3", "kimi_k2", *VLLM_FAMILIES):
        assert name in TOOL_PARSERS.names()


def test_several_calls_and_content():
    text = (
        'Let me compute. <tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(1)"}}\n</tool_call>'
        ' and <tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call> done'
    )
    action = HermesToolParser().parse(text)
    assert action.calls == [
        ToolCall("code_interpreter", {"code": "print(1)"}, "call_0"),
        ToolCall("search", {"q": "x"}, "call_1"),  # arguments given as a JSON string
    ]
    assert action.content == "Let me compute.  and  done" and not action.errors and action.wants_tools


def test_no_calls_is_a_final_answer():
    action = HermesToolParser().parse("The answer is \\boxed{3}.")
    assert not action.wants_tools and action.content == "The answer is \\boxed{3}."


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("{not json}", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"arguments": {}}', "no 'name'"),
        ('{"name": "f", "arguments": 5}', "must be an object"),
        ('{"name": "f", "arguments": "nope"}', "not a JSON object"),
        ("", "empty tool call"),
    ],
)
def test_malformed_calls_become_errors_not_exceptions(body, message):
    action = HermesToolParser().parse(f"x <tool_call>{body}</tool_call> y")
    assert not action.calls and len(action.errors) == 1
    assert message in action.errors[0].message and action.wants_tools


def test_unterminated_call_at_the_end_is_read():
    # Generation that stops on the "</tool_call>" stop string may not return the closing tag.
    action = HermesToolParser().parse('run <tool_call>{"name": "code_interpreter", "arguments": {"code": "print(2)"}}')
    assert action.calls == [ToolCall("code_interpreter", {"code": "print(2)"}, "call_0")]


LS, PWD = ("bash", {"command": "ls"}), ("bash", {"command": "pwd"})

# family: (two good calls, the first good and the second malformed, content expected with the good ones)
FAMILIES = {
    "llama3_json": (
        '<|python_tag|>{"name": "bash", "parameters": {"command": "ls"}}; {"name": "bash", "parameters": {"command": "pwd"}}',
        '<|python_tag|>{"name": "bash", "parameters": {"command": "ls"}}; {"nme": "bash"}',
        "",
    ),
    "mistral": (
        '[TOOL_CALLS][{"name": "bash", "arguments": {"command": "ls"}}, {"name": "bash", "arguments": {"command": "pwd"}}]',
        '[TOOL_CALLS][{"name": "bash", "arguments": {"command": "ls"}}, {"name": "bash", "arguments": 7}]',
        "",
    ),
    "granite": (
        '<|tool_call|>[{"name": "bash", "arguments": {"command": "ls"}}, {"name": "bash", "arguments": {"command": "pwd"}}]',
        '<|tool_call|>[{"name": "bash", "arguments": {"command": "ls"}}, {"nme": "x"}]',
        "",
    ),
    "qwen3_coder": (
        "ok <tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>"
        "<tool_call>\n<function=bash>\n<parameter=command>\npwd\n</parameter>\n</function>\n</tool_call>",
        "ok <tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>"
        "<tool_call>\nbash pwd\n</tool_call>",
        "ok",
    ),
    "deepseek_v3": (
        "hi<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>bash\n```json\n{\"command\": \"ls\"}\n```<｜tool▁call▁end｜>"
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>bash\n```json\n{\"command\": \"pwd\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "hi<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>bash\n```json\n{\"command\": \"ls\"}\n```<｜tool▁call▁end｜>"
        "<｜tool▁call▁begin｜>garbage<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "hi",
    ),
    "kimi_k2": (
        '<|tool_calls_section_begin|><|tool_call_begin|>functions.bash:0<|tool_call_argument_begin|>{"command": "ls"}<|tool_call_end|>'
        '<|tool_call_begin|>functions.bash:1<|tool_call_argument_begin|>{"command": "pwd"}<|tool_call_end|><|tool_calls_section_end|>',
        '<|tool_calls_section_begin|><|tool_call_begin|>functions.bash:0<|tool_call_argument_begin|>{"command": "ls"}<|tool_call_end|>'
        '<|tool_call_begin|>functions.bash:1<|tool_call_argument_begin|>{"command": <|tool_call_end|><|tool_calls_section_end|>',
        "",
    ),
    "glm45": (
        "<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>ls</arg_value>\n</tool_call>"
        "<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>pwd</arg_value>\n</tool_call>",
        "<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>ls</arg_value>\n</tool_call><tool_call></tool_call>",
        "",
    ),
    "minimax_m2": (
        '<minimax:tool_call>\n<invoke name="bash">\n<parameter name="command">ls</parameter>\n</invoke>\n'
        '<invoke name="bash">\n<parameter name="command">pwd</parameter>\n</invoke>\n</minimax:tool_call>',
        '<minimax:tool_call>\n<invoke name="bash">\n<parameter name="command">ls</parameter>\n</invoke>\n<invoke>\n</invoke>\n</minimax:tool_call>',
        "",
    ),
    "openai": (
        '<|channel|>commentary to=functions.bash <|constrain|>json<|message|>{"command": "ls"}<|call|>'
        '<|channel|>commentary to=functions.bash <|constrain|>json<|message|>{"command": "pwd"}<|call|>',
        '<|channel|>commentary to=functions.bash <|constrain|>json<|message|>{"command": "ls"}<|call|>'
        '<|channel|>commentary to=functions.bash <|constrain|>json<|message|>{"command": <|call|>',
        "",
    ),
}


def _calls(action):
    return [(c.name, c.arguments) for c in action.calls]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_reads_calls_and_keeps_good_ones_beside_a_malformed_one(family):
    good, mixed, content = FAMILIES[family]
    parser = make_tool_parser(family, _tokenizer())
    action = parser.parse(good)
    assert _calls(action) == [LS, PWD] and not action.errors and action.content == content
    action = parser.parse(mixed)
    assert _calls(action) == [LS], f"{family}: the good call was dropped beside a malformed one"
    assert len(action.errors) == 1 and action.wants_tools
    plain = parser.parse("The answer is 4.")
    assert not plain.wants_tools and plain.content == "The answer is 4."


@pytest.mark.parametrize(
    ("family", "text"),
    [
        ("llama3_json", '<|python_tag|>{"name": "bash", "parameters": {"command": "ls"'),  # cut off
        ("mistral", '[TOOL_CALLS][{"name": "bash", "arguments": {"command": "ls"}'),
        ("granite", "<|tool_call|>[not json]"),
        ("pythonic", '[bash(command="ls"), bash(command=)]'),  # one Python list: unreadable as a whole
        ("qwen3_coder", "<tool_call>\nbash ls\n</tool_call>"),
        ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>garbage<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
        ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>nonsense<|tool_call_end|><|tool_calls_section_end|>"),
        ("openai", '<|channel|>commentary to=functions.bash <|message|>{"command": <|call|>'),
    ],
)
def test_markers_without_a_readable_call_are_an_error(family, text):
    action = make_tool_parser(family, _tokenizer()).parse(text)
    assert not action.calls and len(action.errors) == 1 and action.wants_tools
    assert action.errors[0].message


def test_pythonic_reads_a_list_of_calls():
    action = make_tool_parser("pythonic", _tokenizer()).parse('[bash(command="ls"), bash(command="pwd")]')
    assert _calls(action) == [LS, PWD] and not action.errors


def test_every_vllm_family_parses_plain_text_or_refuses_the_tokenizer_clearly():
    """Families whose marker tokens the test tokenizer lacks refuse it when built (a ValueError
    naming the family), never later on model output."""
    refused = []
    for family in VLLM_FAMILIES:
        try:
            parser = make_tool_parser(family, _tokenizer())
        except ValueError as e:
            assert repr(family) in str(e)
            refused.append(family)
            continue
        action = parser.parse("plain answer")
        assert not action.wants_tools and action.content == "plain answer", family
    assert len(refused) < len(VLLM_FAMILIES) / 4, refused


def test_a_vllm_family_needs_the_tokenizer():
    with pytest.raises(ValueError, match="'kimi_k2' .* needs the policy's tokenizer"):
        make_tool_parser("kimi_k2", None)


def test_tool_agent_data_gives_special_token_markers_to_the_parser():
    """kimi_k2's markers are special tokens: the turn reaches the parser with them (a decode that
    skipped them would turn every call into plain content), without the end-of-turn token."""
    import numpy as np

    from psrl.environments.chat import ChatObservation
    from psrl.environments.tool.agent_data import ToolAgentData

    tok = _tokenizer()
    data = ToolAgentData(tok, tool_parser=make_tool_parser("kimi_k2", tok))
    data.obs_to_tokens(ChatObservation([{"role": "user", "content": "where?"}]), first=True)
    good = '<|tool_call_begin|>functions.bash:0<|tool_call_argument_begin|>{"command": "ls"}<|tool_call_end|>'
    bad = "<|tool_call_begin|>functions.bash:1<|tool_call_argument_begin|>{oops<|tool_call_end|>"
    turn = f"<|tool_calls_section_begin|>{good}{bad}<|tool_calls_section_end|>"
    action = data.tokens_to_action(np.array(tok.encode(turn, add_special_tokens=False) + [tok.eos_token_id], np.int32))
    assert _calls(action) == [LS] and len(action.errors) == 1 and action.content == ""
