"""``psrl bench trainer`` runs each arm in a process of its own: a process-wide setting one arm
makes (the trainer's glibc allocator setting on CPU) cannot speed up or slow down the other."""

from __future__ import annotations

import os

import pytest

from benchmarks import trainer_throughput as tt
from psrl.models import model_dir

SPEC = (8, 16, 48, 800)  # 8 sequences of 16 + 48 tokens, the tiny model's vocabulary


def test_the_arms_run_in_their_own_processes_in_abba_rounds():
    path = str(model_dir("tiny-qwen2"))
    arms = {}
    try:
        for kind in ("psrl", "hf", "hf_default_allocator"):
            arms[kind] = tt.ArmProcess(kind, path, "cpu", 256, SPEC)
        pids = {arm.proc.pid for arm in arms.values()}
        assert len(pids) == 3 and os.getpid() not in pids
        # The baseline in its fastest mode keeps freed memory as the trainer does; the third arm not.
        assert {k: a.keeps_freed_memory for k, a in arms.items()} == {"psrl": True, "hf": True, "hf_default_allocator": False}
        rates = tt.abba(arms, 8 * 64, steps=1, rounds=3)
        assert all(len(rates[k]) == 3 and min(rates[k]) > 0 for k in rates)
        figures = tt.summarize("tiny", rates)
        assert figures["tiny_vs_hf"] == round(max(rates["psrl"]) / max(rates["hf"]), 3)
        assert figures["tiny_vs_hf_default_allocator"] == round(max(rates["psrl"]) / max(rates["hf_default_allocator"]), 3)
        copies = arms["psrl"].call("copies")
        assert copies["copy_calls_per_step"] > 0
        assert arms["psrl"].call("peak_gb") > 0
    finally:
        for arm in arms.values():
            arm.close()
    assert all(not arm.proc.is_alive() for arm in arms.values())


def test_an_arm_that_cannot_start_says_which_and_why(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(RuntimeError, match=r"the hf arm failed:(.|\n)*no-such-model"):
        tt.ArmProcess("hf", str(missing), "cpu", 256, SPEC)
    with pytest.raises(ValueError, match="unknown arm 'vllm'"):
        tt.ArmProcess("vllm", str(missing), "cpu", 256, SPEC)
