import json

import pytest

from psrl.models import SMOLLM2, TINY_QWEN2, model_dir, resolve_model_path

transformers = pytest.importorskip("transformers")


def test_tiny_qwen2_tokenizer_matches_trained_bpe_and_renders_tools():
    from tokenizers import Tokenizer

    d = model_dir(TINY_QWEN2)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    text = 'What is 12 + 7? \\boxed{19}\n<tool_call>{"name": "x"}</tool_call> héllo  world\n\n'
    assert tok(text)["input_ids"] == raw.encode(text).ids
    assert tok.convert_tokens_to_ids("<tool_call>") == raw.token_to_id("<tool_call>")
    tools = [{"type": "function", "function": {"name": "code_interpreter", "parameters": {}}}]
    msgs = [{"role": "user", "content": "hi"}]
    rendered = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert "code_interpreter" in rendered and rendered.endswith("<|im_start|>assistant\n")
    config = json.loads((d / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["vocab_size"] >= len(tok)


def test_model_paths_resolve():
    assert resolve_model_path(TINY_QWEN2) == str(model_dir(TINY_QWEN2))
    with pytest.raises(FileNotFoundError, match="neither a local directory"):
        resolve_model_path("/no/such/model")
    with pytest.raises(KeyError, match="known: tiny-qwen2"):
        model_dir("gpt-5")


def test_smollm2_is_a_loadable_llama():
    d = model_dir(SMOLLM2)
    config = json.loads((d / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"]
    tok = transformers.AutoTokenizer.from_pretrained(d)
    text = tok.apply_chat_template([{"role": "user", "content": "2+3?"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and len(tok(text)["input_ids"]) > 3
