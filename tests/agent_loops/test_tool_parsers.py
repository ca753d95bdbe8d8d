import pytest

from psrl.agent_loops import TOOL_PARSERS
from psrl.agent_loops.tool_parsers import HermesToolParser, ToolParser
from psrl.environments.tools import ToolCall

pytestmark = pytest.mark.timeout(30)


def test_registered_names():
    assert TOOL_PARSERS.get("hermes") is HermesToolParser is TOOL_PARSERS.get("qwen")
    assert isinstance(HermesToolParser(), ToolParser)


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
