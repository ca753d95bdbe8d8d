"""A SIGKILLed (or OOM-killed) process takes its vLLM engine with it.

vLLM's engine core does not notice its parent's SIGKILL; before ``psrl.engines.reaper`` an
OOM-killed ``psrl train`` left the engine core and its worker running (4 GB here), orphaned."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from psrl.engines.reaper import Reaper

REPO = Path(__file__).resolve().parents[2]

_LAUNCH = r"""
import json, os, time
from psrl.config.rollout import EngineConfig
from psrl.engines.vllm_engine import VLLMEngine
from psrl.models import model_dir
engine = VLLMEngine.launch(str(model_dir("tiny-qwen2")), EngineConfig(max_model_len=256, cpu_kv_cache_gb=0.25, max_num_seqs=4))
print(json.dumps({"ready": os.getpid()}), flush=True)
time.sleep(600)
"""


def _kill(procs: list) -> None:
    for p in procs:
        try:
            p.kill()
        except (ProcessLookupError, psutil.Error):
            continue


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=30)
    return alive


def test_sigkill_of_the_launching_process_stops_the_engine():
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCH], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    children: list[psutil.Process] = []
    try:
        line = ""
        while not line.startswith('{"ready"'):  # vLLM logs to stdout too
            line = proc.stdout.readline()
            assert line, "the engine process exited before it served"
        assert json.loads(line)["ready"] == proc.pid, line
        children = psutil.Process(proc.pid).children(recursive=True)
        engine = [c for c in children if "VLLM" in c.name()]
        assert engine, [c.name() for c in children]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        left = _alive(children)
        assert not left, f"left behind: {[(p.pid, p.name()) for p in left]}"
    finally:
        _kill([proc, *children])


def test_reaper_kills_a_process_tree_when_its_owner_dies_and_spares_it_until_then():
    # The owner: a process that starts a child (with a grandchild) and a Reaper for it.
    script = r"""
import subprocess, sys, time, psutil
from psrl.engines.reaper import Reaper
child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"])
time.sleep(1.0)
reaper = Reaper([psutil.Process(child.pid)])
print(child.pid, flush=True)
time.sleep(600)
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    owner = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    tree: list[psutil.Process] = []
    try:
        child = psutil.Process(int(owner.stdout.readline()))
        tree = [child, *child.children(recursive=True)]
        assert len(tree) == 2
        time.sleep(1.0)
        assert all(p.is_running() for p in tree)  # the watcher waits while its owner lives
        owner.kill()
        owner.wait(10)
        assert not _alive(tree)
    finally:
        _kill([owner, *tree])


def test_reaper_close_after_a_clean_shutdown_leaves_nothing_running():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    reaper = Reaper([psutil.Process(proc.pid)])
    watcher = reaper._proc
    assert watcher is not None and watcher.poll() is None
    reaper.close()
    assert watcher.poll() is not None
    assert proc.wait(10) == -signal.SIGKILL  # what the engine's own shutdown left, the watcher killed


def test_reaper_of_nothing_starts_no_watcher():
    reaper = Reaper([])
    assert reaper._proc is None
    reaper.close()
