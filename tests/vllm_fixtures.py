"""pytest plugin: ONE real vLLM engine on the tiny model, shared by the whole test session.

Start-up costs ~20 s on CPU, so every test that needs vLLM uses ``vllm_engine``. Tests that
change the engine's state put it back: ``restore_vllm_weights`` reloads the original weights
after a test that updates them, and every user leaves the engine resumed.

Enable with ``pytest_plugins = ["tests.vllm_fixtures"]`` in tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from psrl.config.rollout import EngineConfig

VLLM_TEST_CONFIG = EngineConfig(max_model_len=1024, cpu_kv_cache_gb=0.5, max_num_seqs=32)
_CPU_HEAD_SIZE = 32  # the smallest head size vLLM's CPU attention supports


def vllm_ready_model(path: Path, scratch: Path) -> str:
    """``path`` itself, or (stopgap) a copy whose heads vLLM's CPU attention can run.

    A model with head size < 32 gets a copy whose config groups the same weights into fewer,
    larger heads (identical tensor shapes; a different but equally random model). Both vLLM and
    the transformers reference load the copy, so comparisons stay exact. Remove once
    ``psrl.models`` builds the tiny model with head size >= 32.
    """
    config = json.loads((path / "config.json").read_text())
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    if head_dim >= _CPU_HEAD_SIZE:
        return str(path)
    out = scratch / f"{path.name}-heads{_CPU_HEAD_SIZE}"
    if not (out / "config.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        for f in path.iterdir():
            if f.is_file() and f.name != "config.json":
                shutil.copy(f, out / f.name)
        config.update(
            num_attention_heads=heads * head_dim // _CPU_HEAD_SIZE,
            num_key_value_heads=max(1, kv_heads * head_dim // _CPU_HEAD_SIZE),
            head_dim=_CPU_HEAD_SIZE,
        )
        (out / "config.json").write_text(json.dumps(config, indent=1))
    return str(out)


@pytest.fixture(scope="session")
def vllm_model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model's local directory, as the shared vLLM engine serves it."""
    from psrl.models import model_dir

    return vllm_ready_model(model_dir("tiny-qwen2"), tmp_path_factory.mktemp("vllm-models"))


@pytest.fixture(scope="session")
def vllm_original_weights(vllm_model_path: str) -> dict:
    """The tiny model's tensors as loaded at start-up (HF names), for restoring after updates."""
    from safetensors.torch import load_file

    return load_file(os.path.join(vllm_model_path, "model.safetensors"))


@pytest.fixture(scope="session")
def vllm_engine(vllm_model_path: str) -> Iterator:
    """A running ``VLLMEngine`` (float32) shared by every test of the session."""
    from psrl.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine.launch(vllm_model_path, VLLM_TEST_CONFIG, dtype="float32", name="shared")
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture
async def restore_vllm_weights(vllm_engine, vllm_original_weights) -> AsyncIterator[None]:
    """Use in a (anyio) test that updates the shared engine's weights or pauses it: afterwards
    the original weights are back (under a new version number) and the engine is resumed."""
    yield
    version = vllm_engine.statistics().version
    await vllm_engine.update_weights(vllm_original_weights.items(), version + 1)
    await vllm_engine.resume()
