"""``psrl eval``: a config's validation rollouts against a model or a checkpoint; per-data_source
reward, pass@k, tool calls and error rates in eval.json, every episode in samples.parquet."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from math import comb
from pathlib import Path

import numpy as np
import psutil
import pyarrow.parquet as pq
import pytest

from psrl.cli import main as cli_main
from psrl.config import load_config
from psrl.environments.dataset import load_rows, write_rows
from psrl.pipeline.eval_cmd import evaluate, k_values, pass_at_k, print_result
from psrl.testing import ScriptedEngine
from psrl.trajectory import from_arrow

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart" / "config.yaml"
QUICK_VAL = REPO / "recipes" / "quickstart" / "data" / "val.jsonl"


def test_pass_at_k_is_the_unbiased_estimator():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                # By enumeration: the share of k-subsets of the n samples that hold a passing one.
                hits = sum(any(i < c for i in s) for s in itertools.combinations(range(n), k))
                assert pass_at_k(n, c, k) == pytest.approx(hits / comb(n, k), abs=1e-12), (n, c, k)
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0
    assert 0.0 < pass_at_k(1000, 3, 500) < 1.0  # large n: no overflow
    assert k_values(1) == [1] and k_values(4) == [1, 2, 4] and k_values(6) == [1, 2, 4, 6] and k_values(8) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from psrl.models import model_dir

    return AutoTokenizer.from_pretrained(model_dir("tiny-qwen2"))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.timeout(120)
async def test_per_source_rewards_pass_at_k_and_tool_rates_are_exact(tmp_path, tokenizer):
    """Scripted replies (so the numbers are known) through the real multi-turn loop, tool_env and
    bubblewrap python: source "a" always right after one good and one malformed tool call,
    source "b" right in the first episode of each group only."""
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "data_source": "a" if i < 2 else "b",
             "reward_model": {"ground_truth": str(2 * i)}} for i in range(4)]
    data = write_rows(tmp_path / "rows.jsonl", rows)
    call = "<tool_call>" + json.dumps({"name": "code_interpreter", "arguments": {"code": "print(1 + 1)"}}) + "</tool_call>"
    turns: dict[str, int] = {}

    def script(req):
        row, ep = int(req.session_id[4:].split("/")[0]), int(req.session_id.split("/")[1])  # "eval{row}/{j}"
        turns[req.session_id] = turns.get(req.session_id, 0) + 1
        if row < 2 and turns[req.session_id] == 1:
            return tokenizer.encode(call + "<tool_call>{bad}</tool_call>") + [tokenizer.eos_token_id]
        right = row < 2 or ep == 0
        return tokenizer.encode(f"\\boxed{{{2 * row if right else 99}}}") + [tokenizer.eos_token_id]

    cfg = load_config(None, [
        "train_actor_rollout_ref.rollout.sampling.n=4", "train_actor_rollout_ref.rollout.multi_turn.enable=true",
        "train_actor_rollout_ref.rollout.agent.default_agent_loop=multi_turn_agent",
        f"sandbox.spec.state_dir={tmp_path / 'sb'}", "sandbox.pool.warm=0", "logging.progress_bar=false",
    ])
    result = await evaluate(cfg, load_rows(data), tmp_path / "out", engine=ScriptedEngine(script), tokenizer=tokenizer,
                            info={"model": "scripted"})
    a, b, total = (result["sources"][k] for k in ("a", "b", "all"))
    assert (a["episodes"], b["episodes"], total["episodes"], total["groups"]) == (8, 8, 16, 4)
    assert a["reward_mean"] == 1.0 and b["reward_mean"] == pytest.approx(0.25) and total["reward_mean"] == pytest.approx(0.625)
    assert a["pass_at_k"] == {"pass@1": 1.0, "pass@2": 1.0, "pass@4": 1.0}
    assert b["pass_at_k"] == pytest.approx({"pass@1": 0.25, "pass@2": 0.5, "pass@4": 1.0})  # c=1 of n=4: k/4
    assert (a["tool_calls"], a["tool_calls_per_episode"], a["tool_error_rate"], a["turns_mean"]) == (16.0, 2.0, 0.5, 2.0)
    assert (b["tool_calls"], b["tool_error_rate"], b["turns_mean"]) == (0.0, 0.0, 1.0)
    assert total["crash_rate"] == total["timeout_rate"] == 0.0
    saved = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert saved["sources"] == result["sources"] and saved["model"] == "scripted" and saved["n"] == 4
    table = pq.read_table(tmp_path / "out" / "samples.parquet")
    trajs = from_arrow(table)
    assert len(trajs) == 16 and sorted({t.data_source for t in trajs}) == ["a", "b"]
    texts = table.column("response_text").to_pylist()
    assert sum("\\boxed{99}" in s for s in texts) == 6 and all(p.startswith("<|im_start|>") for p in table.column("prompt_text").to_pylist())
    assert not list((tmp_path / "sb").glob("sb-*"))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.timeout(300)  # the shared engine's start-up counts here when this test runs first
async def test_quickstart_validation_on_real_vllm(tmp_path, vllm_engine, tokenizer, capsys):
    """The quickstart's validation set (32 rows x 4) on the tiny model in vLLM."""
    cfg = load_config(QUICKSTART, ["logging.progress_bar=false"])
    result = await evaluate(cfg, load_rows([QUICK_VAL]), tmp_path / "out", engine=vllm_engine, tokenizer=tokenizer)
    s = result["sources"]
    assert set(s) == {"digits", "all"} and s["digits"] == s["all"]
    trajs = from_arrow(pq.read_table(tmp_path / "out" / "samples.parquet"))
    assert len(trajs) == 128 and all(t.status.value != "failed" for t in trajs)
    rewards = np.array([t.reward for t in trajs])
    assert s["all"]["reward_mean"] == pytest.approx(rewards.mean())
    assert s["all"]["pass_at_k"]["pass@1"] == pytest.approx((rewards >= 1.0).mean())
    p = s["all"]["pass_at_k"]
    assert 0.0 < p["pass@1"] <= p["pass@2"] <= p["pass@4"] < 1.0  # the random tiny model: sometimes a digit
    print_result(result)
    out = capsys.readouterr().out
    assert "pass@4" in out and "digits" in out and f"{s['all']['reward_mean']:.4f}" in out


def test_bad_arguments_are_named(tmp_path, capsys):
    def run(*argv: str) -> tuple[int, str]:
        try:
            rc = cli_main(["eval", *argv, f"logging.output_dir={tmp_path / 'run'}"])
        except SystemExit as e:  # argparse
            rc = e.code
        return rc, capsys.readouterr().err

    q = str(QUICKSTART)
    rc, err = run(q, "--checkpoint", str(tmp_path), "--model", "tiny-qwen2")
    assert rc == 2 and "not allowed with argument" in err
    rc, err = run(q, "--data", str(tmp_path / "missing.jsonl"))
    assert rc == 2 and "data file not found" in err and "missing.jsonl" in err
    rc, err = run(q, "data.val_files=[]")
    assert rc == 2 and "--data FILE" in err
    rc, err = run(q, "--checkpoint", str(tmp_path / "nope"))
    assert rc == 2 and "--checkpoint" in err and "no such directory" in err
    rc, err = run(q, "--checkpoint", str(tmp_path), "-o", str(tmp_path / "o"))
    assert rc == 2 and "not a checkpoint" in err
    rc, err = run(q, "--model", str(tmp_path / "nomodel"))
    assert rc == 2 and "--model" in err and "nomodel" in err
    rc, err = run(q, "--config", q)
    assert rc == 2 and "--config only applies with --checkpoint" in err
    rc, err = run(q, "--limit", "0")
    assert rc == 2 and "--limit must be at least 1" in err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint of a real trainer step (two steps at a large learning rate) on a random
    tiny Qwen2, with the run's config beside it as ``psrl train`` writes it; and the trainer's
    live HF weights."""
    import torch

    sys.path.insert(0, str(REPO / "tests" / "export"))
    from export_workers import model_with_tokenizer, train_and_save

    d = tmp_path_factory.mktemp("ckpt")
    model = model_with_tokenizer(d / "model")
    threads = torch.get_num_threads()
    try:
        train_and_save(0, model, 1, 1, str(d / "ckpt"), str(d / "live.pt"))
    finally:
        torch.set_num_threads(threads)
    (d / "ckpt" / "config.yaml").write_text(f"trainer:\n  model_path: {model}\n")
    return d / "ckpt", torch.load(d / "live.pt", weights_only=False)["state"]


@pytest.mark.timeout(120)
def test_checkpoint_is_exported_by_psrl_exports_code_for_the_engine(tmp_path, checkpoint):
    import argparse

    import torch
    from safetensors.torch import load_file

    from psrl.pipeline.eval_cmd import prepare

    ckpt, live = checkpoint
    args = argparse.Namespace(recipe=str(QUICKSTART), checkpoint=str(ckpt), model=None, data=None, output=str(tmp_path / "out"),
                              limit=2, config=None)
    cfg, rows, out, info = prepare(load_config(QUICKSTART), args)
    hf = tmp_path / "out" / "hf"
    assert cfg.gen_actor_rollout_ref.model.path == str(hf) == info["model"] and info["checkpoint"] == str(ckpt)
    assert len(rows) == 2 and out == tmp_path / "out" and info["data"] == [str(QUICK_VAL.relative_to(REPO))]
    assert json.loads((hf / "psrl_export.json").read_text())["step"] == 2
    exported = load_file(str(hf / "model.safetensors"))
    assert set(exported) == set(live) and all(torch.equal(exported[k], v) for k, v in live.items())


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_checkpoint_goes_through_export_to_the_engine(tmp_path, checkpoint):
    """The CLI on that checkpoint: exported into OUTPUT/hf, and the engine's log-probs are
    those of the exported (trained) weights. ~40 s idle, 2-4 min at load 12-16."""
    import torch

    ckpt, live = checkpoint
    out = tmp_path / "eval"
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "psrl.cli", "eval", str(QUICKSTART), "--checkpoint", str(ckpt), "-o", str(out),
           "--limit", "4", "logging.progress_bar=false", "gen_actor_rollout_ref.rollout.engine.cpu_kv_cache_gb=0.5"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=380, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "pass@4" in proc.stdout and "eval.json" in proc.stdout
    result = json.loads((out / "eval.json").read_text())
    assert result["model"] == str(out / "hf") and result["checkpoint"] == str(ckpt)
    assert result["sources"]["all"]["episodes"] == 16
    # The engine served the trained weights: its log-probs match a transformers forward of them.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32).eval()
    for t in from_arrow(pq.read_table(out / "samples.parquet"))[:4]:
        ids = torch.tensor(np.concatenate([t.prompt_ids, t.response_ids]), dtype=torch.long)[None]
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0].float(), -1)
        pos = torch.arange(len(t.prompt_ids) - 1, ids.shape[1] - 1)
        np.testing.assert_allclose(t.logprobs, logp[pos, ids[0, pos + 1]].numpy(), atol=1e-4, rtol=0)


@pytest.mark.timeout(300)
def test_sigterm_to_psrl_eval_stops_its_engine(tmp_path):
    """``kill PID`` (or a scheduler's, or ``timeout``'s, SIGTERM to the main process only) stops
    ``psrl eval`` like Ctrl-C does: exit code 130 and no vLLM process left behind. Before, the
    engine core outlived it, orphaned, holding its memory and a core."""
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "psrl.cli", "eval", str(QUICKSTART), "--model", "tiny-qwen2", "-o", str(tmp_path / "o"),
           "logging.progress_bar=false", f"logging.output_dir={tmp_path / 'run'}", "gen_actor_rollout_ref.rollout.engine.cpu_kv_cache_gb=0.5",
           "train_actor_rollout_ref.rollout.sampling.n=512", "train_actor_rollout_ref.rollout.sampling.max_tokens=64"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    children: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + 240
        while not any("VLLM::" in _name(c) for c in children.values()):  # the engine core is starting
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-4000:] if proc.poll() is not None else "no engine"
            children.update({c.pid: c for c in psutil.Process(proc.pid).children(recursive=True)})
            time.sleep(0.5)
        time.sleep(5)
        children.update({c.pid: c for c in psutil.Process(proc.pid).children(recursive=True)})
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 130, out[-4000:]
        assert "interrupted" in out
        _, alive = psutil.wait_procs(list(children.values()), timeout=60)
        assert not alive, f"left behind: {[(p.pid, _name(p)) for p in alive]}"
    finally:
        for p in [proc.pid, *children]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                continue


def _name(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()) or p.name()
    except psutil.Error:  # gone already
        return ""
