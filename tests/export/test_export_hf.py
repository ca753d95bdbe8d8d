"""``psrl export``: trainer checkpoints (tensor / pipeline parallel shards) -> a Hugging Face
directory that transformers loads and that scores tokens as the trainer did."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from export_workers import model_with_tokenizer, tokens, train_and_save
from psrl.trainer.distributed import spawn_ranks
from psrl.trainer.export import ExportError, export_checkpoint, find_trainer_step

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")


def hf_logprobs(model_dir, trajs) -> list[np.ndarray]:
    """Log-probs of each response token under a transformers forward (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for t in trajs:
            ids = torch.tensor(np.concatenate([t.prompt_ids, t.response_ids]), dtype=torch.long)[None]
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            pos = torch.arange(len(t.prompt_ids) - 1, ids.shape[1] - 1)
            out.append(logp[pos, ids[0, pos + 1]].numpy())
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Checkpoints of the same training at tp=2 and at pp=2 (two processes each)."""
    root = tmp_path_factory.mktemp("export")
    cache = {}

    def get(family: str, tied: bool, tp: int, pp: int):
        key = (family, tied, tp, pp)
        if key not in cache:
            d = root / "-".join(map(str, key))
            model = model_with_tokenizer(d / "model", tied=tied, family=family)
            if tp * pp == 1:  # in this process, as the single-process trainer tests do
                threads = torch.get_num_threads()
                try:
                    train_and_save(0, model, 1, 1, str(d / "ckpt"), str(d / "live.pt"))
                finally:
                    torch.set_num_threads(threads)
            else:
                spawn_ranks(train_and_save, tp * pp, model, tp, pp, str(d / "ckpt"), str(d / "live.pt"))
            cache[key] = (model, d / "ckpt", torch.load(d / "live.pt", weights_only=False), d)
        return cache[key]

    return get


@pytest.mark.timeout(180)
@pytest.mark.parametrize("family,tied,tp,pp", [
    ("qwen2", True, 1, 1),
    pytest.param("qwen2", True, 2, 1, marks=pytest.mark.slow),  # ~40 s each: two spawned ranks
    pytest.param("qwen2", True, 1, 2, marks=pytest.mark.slow),
    pytest.param("llama", False, 2, 1, marks=pytest.mark.slow),
],
                         ids=["qwen2", "qwen2-tp2", "qwen2-pp2", "llama-untied-tp2"])
def test_export_gathers_shards_and_scores_like_the_trainer(runs, family, tied, tp, pp):
    model, ckpt, live, d = runs(family, tied, tp, pp)
    out = export_checkpoint(ckpt, d / "hf", model)
    from safetensors.torch import load_file

    exported = load_file(str(out / "model.safetensors"))
    # Bit-identical to what the running trainer would send to the engines.
    assert set(exported) == set(live["state"])
    for k, v in live["state"].items():
        assert torch.equal(exported[k], v), k
    src = load_file(str(next((d / "model").glob("*.safetensors"))))
    assert not torch.equal(exported["model.embed_tokens.weight"], src["model.embed_tokens.weight"]), "training changed nothing"
    for a, b in zip(hf_logprobs(out, tokens()), live["logprobs"], strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= files
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    info = json.loads((out / "psrl_export.json").read_text())
    assert info["layout"] == {"tp": tp, "pp": pp} and info["step"] == 2


@pytest.mark.timeout(180)
def test_cli_finds_the_config_beside_the_checkpoint_and_names_bad_input(runs, tmp_path):
    model, ckpt, live, d = runs("qwen2", True, 1, 1)
    (ckpt / "config.yaml").write_text(f"trainer:\n  model_path: {model}\n")
    cmd = [sys.executable, "-m", "psrl.cli", "export", str(ckpt), "-o", str(tmp_path / "hf")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "hf" / "model.safetensors").is_file() and str(tmp_path / "hf") in r.stdout
    (ckpt / "config.yaml").unlink()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "config.yaml" in r.stderr and "--config" in r.stderr
    r = subprocess.run([*cmd[:4], str(tmp_path), "-o", str(tmp_path / "x"), "--config", "/nonexistent.yaml"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "error" in r.stderr
    with pytest.raises(ExportError, match="not a checkpoint"):
        find_trainer_step(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_shard_missing_from_a_tp2_checkpoint_is_named(runs, tmp_path):
    model, ckpt, _, _ = runs("qwen2", True, 2, 1)
    step = find_trainer_step(ckpt)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tp0_pp0.pt").symlink_to(step / "tp0_pp0.pt")
    with pytest.raises(ExportError, match=r"lacks \['tp1_pp0.pt'\]"):
        export_checkpoint(broken, tmp_path / "hf2", model)


async def _greedy(engine, prompts) -> list[list[int]]:
    from psrl.engines import GenerateRequest, SamplingParams

    out = []
    for p in prompts:  # one at a time: the same batch composition on both engines
        res = await engine.generate(GenerateRequest(np.asarray(p, np.int32), SamplingParams(temperature=0.0, max_tokens=24)))
        assert res.error is None, res.error
        out.append((res.output_ids.tolist(), res.logprobs))
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllm_serves_the_export_with_the_same_greedy_tokens_as_the_synced_engine(runs, tmp_path):
    """The engine during training (source model + the trainer's weights synced in) and a fresh
    vLLM on the exported directory generate the same greedy tokens."""
    import anyio

    from psrl.config.rollout import EngineConfig
    from psrl.engines.vllm_engine import VLLMEngine

    model, ckpt, live, _ = runs("qwen2", True, 2, 1)
    prompts = [t.prompt_ids for t in tokens()] + [np.arange(5, 25), np.array([3, 17, 99, 250, 400, 7])]
    cfg = EngineConfig(max_model_len=1024, cpu_kv_cache_gb=0.5, max_num_seqs=8)

    engine = VLLMEngine.launch(model, cfg, dtype="float32")
    try:
        before = anyio.run(_greedy, engine, prompts)
        anyio.run(engine.update_weights, list(live["state"].items()), 1)
        synced = anyio.run(_greedy, engine, prompts)
    finally:
        engine.close()
    out = export_checkpoint(ckpt, tmp_path / "hf", model)
    engine = VLLMEngine.launch(str(out), cfg, dtype="float32")
    try:
        exported = anyio.run(_greedy, engine, prompts)
    finally:
        engine.close()
    assert [t for t, _ in synced] != [t for t, _ in before], "training should have changed the greedy output"
    assert [t for t, _ in exported] == [t for t, _ in synced]
    # vLLM's log-probs on the export match transformers' (which match the trainer's, above).
    from psrl.trajectory import Trajectory

    scored = [Trajectory(key=str(i), group_id="g", prompt_ids=p, response_ids=t, loss_mask=np.ones(len(t)),
                         logprobs=lp, versions=np.zeros(len(t)), turn_bounds=[[0, len(t)]], turn_rewards=[0.0])
              for i, (p, (t, lp)) in enumerate(zip(prompts, exported, strict=True))]
    for ref, t in zip(hf_logprobs(out, scored), scored, strict=True):
        np.testing.assert_allclose(t.logprobs, ref, atol=1e-4, rtol=0)
    exported = [t for t, _ in exported]
    # transformers agrees on the exported directory too.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for p, toks in zip(prompts, exported, strict=True):
        gen = hf.generate(torch.tensor(np.asarray(p, np.int64))[None], max_new_tokens=24, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        assert gen[0, len(p):].tolist()[: len(toks)] == toks
