"""``trainer.cpu_keep_freed_memory``: after ``keep_freed_memory`` a block freed by one step is
reused by the next without page faults (glibc otherwise maps and unmaps every block over 32 MB).
Measured in fresh processes: the setting is process-wide."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import json, resource, sys
import torch
import psrl.trainer.cpu_compat  # what the trainer imports (pyarrow among it) shapes the heap, as there
from psrl.allocator import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):  # warm-up: the heap grows until a freed 100 MB block has room in it
    x = torch.empty(25 * 2**20); x.fill_(1); del x
f0 = faults()
for _ in range(10):
    x = torch.empty(25 * 2**20); x.fill_(1); del x
print(json.dumps({"applied": applied, "faults_per_block": (faults() - f0) / 10}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(240)
def test_freed_blocks_are_reused_without_page_faults():
    default, kept = _probe("default"), _probe("keep")
    assert kept["applied"] is True
    pages = 100 * 2**20 // 4096  # 25,600 pages of 4 KiB in one block
    assert default["faults_per_block"] > pages / 2, default  # glibc's default: every block faulted anew
    assert kept["faults_per_block"] < pages / 50, kept  # reused: (almost) none
