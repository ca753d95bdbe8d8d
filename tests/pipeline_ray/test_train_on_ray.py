"""``psrl train ... launcher=ray ray.address=auto`` joining a Ray head started on loopback, as a
user runs it: a vLLM engine replica, a Megatron-Core trainer rank and the transfer queue
(controller + storage unit, tcp with CURVE) as actors on that cluster, two sync steps of GRPO on
the tiny model. Afterwards the head is still up and none of the run's actors is left on it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from psrl.testing.sim_tasks import write_digit_task

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart" / "config.yaml"
ACTOR_CLASSES = ("EngineActor", "TrainerRankActor", "QueueServiceActor")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    return {
        **os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
        # A private loopback cluster: no token (Ray's default token lives in ~/.ray, shared by
        # every cluster of this user on the machine).
        "RAY_AUTH_MODE": "disabled", **extra,
    }


def _descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _titles(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(" ".join(p.cmdline()))
        except psutil.Error:
            pass
    return out


@pytest.fixture
def ray_head():
    """A private Ray head on 127.0.0.1 (its own temp dir and process group), stopped by signal:
    ``ray stop`` would stop every cluster on the machine."""
    port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="psrl-ray-", dir="/tmp")  # short: Ray puts unix sockets in it
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--port={port}", "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}"],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not any("gcs_server" in t for t in _titles(_descendants(head))) or not _port_open(port):
            assert head.poll() is None, head.stdout.read()
            assert time.monotonic() < deadline, "the Ray head did not come up within 90 s"
            time.sleep(0.5)
        yield head, f"127.0.0.1:{port}"
    finally:
        procs = _descendants(head)
        head.terminate()  # `ray start --block` stops its cluster on SIGTERM
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        _, alive = psutil.wait_procs(procs, timeout=20)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        shutil.rmtree(temp_dir, ignore_errors=True)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def tiny_model() -> str:
    from psrl.models import model_dir

    return str(model_dir("tiny-qwen2"))


@pytest.mark.slow  # ~100 s on a loaded 2-core machine (vLLM + Megatron start-up in actors)
@pytest.mark.timeout(300)
def test_psrl_train_joins_a_running_cluster_and_leaves_no_actor_behind(tmp_path, tiny_model, ray_head):
    head, address = ray_head
    train, val = write_digit_task(tmp_path / "data", train=32, val=4)
    args = [
        sys.executable, "-m", "psrl.cli", "train", str(QUICKSTART),
        f"data.train_files=[{train}]", f"data.val_files=[{val}]", f"*.model.path={tiny_model}",
        f"logging.output_dir={tmp_path / 'run'}", f"trainer.checkpoint_dir={tmp_path / 'ckpt'}", "logging.progress_bar=false",
        "data.batch_size=2", "gen_actor_rollout_ref.rollout.sampling.n=2", "trainer.mode=sync", "trainer.total_steps=2",
        "trainer.eval_every=0", "trainer.save_every=0", "gen_actor_rollout_ref.rollout.engine.cpu_kv_cache_gb=0.5",
        "launcher=ray", "ray.address=auto", "transfer_queue.curve_auth=true", "transfer_queue.storage_units=1",
        "ray.engine.num_cpus=1", "ray.trainer.num_cpus=1", "ray.queue.num_cpus=0",
    ]
    # "auto" finds the cluster through RAY_ADDRESS, as on a node where `ray start` ran.
    out = subprocess.run(args, env=_env(RAY_ADDRESS=address), capture_output=True, text=True, timeout=280, cwd=tmp_path)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]

    # Every part ran as an actor on the joined cluster, the queue on loopback tcp with CURVE.
    assert "Started a local Ray instance" not in log
    assert "engine replica on ray" in log and "trainer on ray" in log
    queue_line = next(line for line in log.splitlines() if "transfer queue on ray" in line)
    assert "controller=tcp://127.0.0.1:" in queue_line and "curve=True" in queue_line

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train_steps] == [1, 2]
    for r in train_steps:
        assert r["samples"] == 4.0  # 2 groups of 2
        assert r["staleness/max"] == 0.0  # sync: on-policy, the weights reached the engine actor first
        assert r["version"] == float(r["step"]) and r["time/weight_sync_s"] > 0
        assert r["train/samples"] == 4.0 and r["train/entropy"] > 0  # the trainer actor stepped on them
    step_dir = tmp_path / "ckpt" / "step_000002"
    assert (step_dir / "pipeline.json").is_file() and any((step_dir / "trainer").iterdir())

    # The head is still up, and the run's actors are gone from it.
    assert head.poll() is None
    deadline = time.monotonic() + 30
    while (left := [t for t in _titles(_descendants(head)) if t.startswith(tuple(f"ray::{c}" for c in ACTOR_CLASSES))]):
        assert time.monotonic() < deadline, f"actors left on the cluster: {left}"
        time.sleep(0.5)
