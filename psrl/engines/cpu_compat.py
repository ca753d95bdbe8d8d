"""Stopgap for random test models whose attention heads vLLM's CPU backend cannot run.

vLLM's CPU attention supports head sizes 32, 64, 80, ... A random test model with smaller heads
(the offline ``tiny-qwen2`` as built today: 4 heads of 16) can be re-read as fewer, larger heads:
the tensors keep their shapes, only ``config.json`` changes. That is a *different* model (the
attention is grouped differently), harmless for a random model used by tests and benchmarks and
wrong for a trained one, which is why this is never applied implicitly. Remove once
``psrl.models`` builds its tiny model with head size >= 32.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

MIN_CPU_HEAD_SIZE = 32


def regrouped_for_cpu(model_path: str | Path, scratch: str | Path) -> str:
    """``model_path`` if vLLM on CPU can run its heads, else a regrouped copy under ``scratch``."""
    path = Path(model_path)
    config = json.loads((path / "config.json").read_text())
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    if head_dim >= MIN_CPU_HEAD_SIZE:
        return str(path)
    out = Path(scratch) / f"{path.name}-heads{MIN_CPU_HEAD_SIZE}"
    if not (out / "config.json").exists():
        tmp = Path(scratch) / f".{out.name}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for f in path.iterdir():
            if f.is_file() and f.name != "config.json":
                shutil.copy(f, tmp / f.name)
        config.update(
            num_attention_heads=heads * head_dim // MIN_CPU_HEAD_SIZE,
            num_key_value_heads=max(1, kv_heads * head_dim // MIN_CPU_HEAD_SIZE),
            head_dim=MIN_CPU_HEAD_SIZE,
        )
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return str(out)
