"""A real Megatron SFT step on the tiny model, ``psrl sft`` end to end (checkpoint, config,
Hugging Face export that transformers loads), and ReTool demonstrations through bubblewrap."""

from __future__ import annotations

import json
import subprocess
import sys

import anyio
import numpy as np
import pyarrow.parquet as pq
import pytest

from psrl.config import TrainerConfig
from psrl.environments.tool.python_tool import PYTHON_SCHEMA
from psrl.models import model_dir
from psrl.sft.data import load_samples

pytestmark = pytest.mark.timeout(300)

CONVO = [
    {"role": "user", "content": "Compute 12 * 3 + 4."},
    {"role": "assistant", "content": "Running it.", "tool_calls": [{"function": {"name": "code_interpreter", "arguments": {"code": "print(12 * 3 + 4)"}}}]},
    {"role": "tool", "content": "40"},
    {"role": "assistant", "content": "\\boxed{40}"},
]


@pytest.fixture(scope="module")
def tiny_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir("tiny-qwen2"))


def test_sft_steps_lower_the_loss_on_the_tiny_model(tiny_tok, tmp_path):
    from psrl.trainer.trainer import MegatronTrainer

    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"messages": CONVO, "tools": [PYTHON_SCHEMA]}) + "\n")
    samples, _ = load_samples([str(f)], tiny_tok)
    cfg = TrainerConfig(device="cpu", checkpoint_dir=str(tmp_path / "ck"), optim={"lr": 3e-3}, seed=0)
    with MegatronTrainer(model_dir("tiny-qwen2"), cfg) as trainer:
        history = [trainer.sft_step(samples) for _ in range(6)]
    losses = [m["loss"] for m in history]
    assert losses[0] > 5.0  # a random model: about log(vocab)
    assert losses[-1] < 0.8 * losses[0], losses
    assert history[-1]["token_acc"] > history[0]["token_acc"]
    assert history[0]["loss_tokens"] == float(samples[0].num_loss_tokens)
    assert all(m["tokens_per_s"] > 0 and m["update_ok"] == 1.0 for m in history)


def test_psrl_sft_writes_checkpoint_config_and_hf(tiny_tok, tmp_path):
    f = tmp_path / "chat.jsonl"
    f.write_text("".join(json.dumps({"messages": CONVO, "tools": [PYTHON_SCHEMA]}) + "\n" for _ in range(4)))
    out = tmp_path / "sft"
    yaml_file = tmp_path / "sft.yaml"
    yaml_file.write_text("sft: {}\n")
    cmd = [sys.executable, "-m", "psrl.cli", "sft", str(yaml_file), f"sft.data=[{f}]", "gen_actor_rollout_ref.model.path=tiny-qwen2",
           "sft.batch_size=2", "sft.epochs=2", "sft.lr=3e-3", f"sft.save_dir={out}", f"logging.output_dir={out}", "trainer.device=cpu"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("sft step")]
    assert len(lines) == 4 and "token_acc" in lines[0] and "tokens/s" in lines[0]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["last_loss"] < summary["first_loss"]
    assert (out / "latest").is_file() and (out / "config.yaml").is_file()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "hf")  # what engines and `psrl train` start from
    assert model.config.num_hidden_layers == 2
    # `psrl export` reads the same checkpoint (config.yaml beside it).
    res = subprocess.run([sys.executable, "-m", "psrl.cli", "export", str(out), "-o", str(tmp_path / "hf2")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    from safetensors.numpy import load_file

    w1, w2 = load_file(out / "hf" / "model.safetensors"), load_file(tmp_path / "hf2" / "model.safetensors")
    assert w1.keys() == w2.keys() and all(np.array_equal(w1[k], w2[k]) for k in w1)


def test_bad_sft_config_is_a_usage_error(tmp_path):
    res = subprocess.run([sys.executable, "-m", "psrl.cli", "config", "show", "recipes/retool/sft.yaml", "sft.epoch=2"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "unknown key sft.epoch; did you mean epochs" in res.stderr


def test_retool_demos_through_bubblewrap_are_rewarded_and_render_like_chat(tmp_path):
    from transformers import AutoTokenizer

    from psrl.sft.data import render_messages
    from psrl.sft.demos import QUESTION, demo_turns, make_demos
    from psrl.sft.stats import trajectory_stats

    out = tmp_path / "demos.parquet"
    summary = anyio.run(lambda: make_demos("recipes/retool/config.yaml", str(out), rows=3, seed=1,
                                           overrides=[f"sandbox.spec.state_dir={tmp_path / 'sb'}", "sandbox.pool.warm=0"]), backend="asyncio")
    assert (summary.episodes, summary.kept) == (3, 3)
    stats = trajectory_stats(out)
    assert stats["accuracy"] == 1.0 and stats["well_formed_rate"] == 1.0 and stats["exec_error_rate"] == 0.0
    tok = AutoTokenizer.from_pretrained(model_dir("smollm2-135m"))
    rows = pq.read_table(out).to_pylist()
    for r in rows:
        text = tok.decode(r["prompt_ids"], skip_special_tokens=False)
        q = list(QUESTION.finditer(text))[-1]
        a, b, op, c = map(lambda g: int(g) if g.isdigit() else g, q.groups())
        answer = str(a * b + c if op == "+" else a * b - c)
        say, code = demo_turns(q, None, seed=1)
        final, _ = demo_turns(q, answer, seed=1)
        convo = [
            {"role": "user", "content": text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]},
            {"role": "assistant", "content": say, "tool_calls": [{"function": {"name": "code_interpreter", "arguments": {"code": code}}}]},
            {"role": "tool", "content": answer, "name": "code_interpreter"},
            {"role": "assistant", "content": final},
        ]
        prompt, response, mask = render_messages(tok, convo, [PYTHON_SCHEMA])
        # The chat rendering of the same conversation is token for token the rollout's trajectory.
        assert prompt.tolist() == r["prompt_ids"] and response.tolist() == r["response_ids"] and mask.tolist() == r["loss_mask"]
        assert f"\\boxed{{{answer}}}" in tok.decode(r["response_ids"])
