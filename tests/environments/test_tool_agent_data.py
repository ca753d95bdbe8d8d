import numpy as np
import pytest

from psrl.agent_loops.tool_parsers import HermesToolParser
from psrl.environments import AGENT_DATA, ComponentContext, build_component
from psrl.environments.chat import ChatObservation
from psrl.environments.tool.agent_data import ToolAgentData
from psrl.environments.tool.python_tool import PYTHON_SCHEMA
from psrl.models import model_dir

pytestmark = pytest.mark.timeout(120)

PROMPT = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "What is 6*7?"}]


@pytest.fixture(scope="module")
def qwen_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir("tiny-qwen2"))


@pytest.fixture(scope="module")
def smol_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir("smollm2-135m"))


def _text(tok, ids):
    return tok.decode(np.asarray(ids).tolist(), skip_special_tokens=False)


def test_chat_mode_turn_by_turn(qwen_tok):
    data = ToolAgentData(qwen_tok, tool_parser=HermesToolParser())
    prompt = data.obs_to_tokens(ChatObservation(PROMPT, tools=[PYTHON_SCHEMA]), first=True)
    text = _text(qwen_tok, prompt)
    assert '"name": "code_interpreter"' in text and text.endswith("<|im_start|>assistant\n")
    assert text == qwen_tok.apply_chat_template(PROMPT, tools=[PYTHON_SCHEMA], tokenize=False, add_generation_prompt=True)

    turn = 'Run it <tool_call>{"name": "code_interpreter", "arguments": {"code": "print(6*7)"}}</tool_call>'
    out = np.array(qwen_tok.encode(turn) + [qwen_tok.eos_token_id], np.int32)
    action = data.tokens_to_action(out)
    assert action.calls[0].arguments == {"code": "print(6*7)"} and action.content == "Run it"

    obs = data.obs_to_tokens(ChatObservation([{"role": "tool", "content": "42"}]), first=False)
    assert _text(qwen_tok, obs) == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_template_without_tools_gets_them_in_the_system_prompt(smol_tok):
    data = ToolAgentData(smol_tok, tool_parser=HermesToolParser(), system_prompt="Think step by step.")
    text = _text(smol_tok, data.obs_to_tokens(ChatObservation(PROMPT, tools=[PYTHON_SCHEMA]), first=True))
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nSolve it.\n\nThink step by step.\n\nYou can call these functions")
    assert '"name": "code_interpreter"' in system and "<tool_call>" in system


def test_completion_mode_appends_raw_text(qwen_tok):
    data = ToolAgentData(qwen_tok, tool_parser=HermesToolParser(), mode="completion")
    data.obs_to_tokens(ChatObservation(PROMPT, tools=[PYTHON_SCHEMA]), first=True)
    # Stopped on the "</tool_call>" stop string, which the engine did not return.
    out = np.array(qwen_tok.encode('x <tool_call>{"name": "code_interpreter", "arguments": {"code": "print(1)"}}'), np.int32)
    assert data.tokens_to_action(out).calls[0].arguments == {"code": "print(1)"}
    obs = data.obs_to_tokens(ChatObservation([{"role": "tool", "content": "1"}]), first=False)
    assert _text(qwen_tok, obs) == "</tool_call>\n<tool_response>\n1\n</tool_response>\n"
    # No template between turns: no <|im_start|>, no end of turn.
    out = np.array(qwen_tok.encode('<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(2)"}}</tool_call>'), np.int32)
    data.tokens_to_action(out)
    assert _text(qwen_tok, data.obs_to_tokens(ChatObservation([{"role": "tool", "content": "2"}]), first=False)) == "\n<tool_response>\n2\n</tool_response>\n"


def test_built_from_the_runner_context(qwen_tok):
    assert AGENT_DATA.get("tool_agent_data") is ToolAgentData
    ctx = ComponentContext(tokenizer=qwen_tok, tool_parser=HermesToolParser(), observation_mode="completion")
    data = build_component(ToolAgentData, ctx, {"system_prompt": "hi"})
    assert data.mode == "completion" and data.system_prompt == "hi"
    with pytest.raises(ValueError, match="needs the policy's tokenizer"):
        build_component(ToolAgentData, ComponentContext(tool_parser=HermesToolParser()), {})
    with pytest.raises(ValueError, match="tool-call parser"):
        build_component(ToolAgentData, ComponentContext(tokenizer=qwen_tok), {})
