"""pytest plugin: ONE real vLLM engine on the tiny model, shared by the whole test session.

Start-up costs ~20 s on CPU, so every test that needs vLLM uses ``vllm_engine``. Tests that
change the engine's state put it back: ``restore_vllm_weights`` reloads the original weights
after a test that updates them, and every user leaves the engine resumed.

Enable with ``pytest_plugins = ["tests.vllm_fixtures"]`` in tests/conftest.py.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest

from psrl.config.rollout import EngineConfig

VLLM_TEST_CONFIG = EngineConfig(max_model_len=1024, cpu_kv_cache_gb=0.5, max_num_seqs=32)


@pytest.fixture(scope="session")
def vllm_model_path() -> str:
    """The tiny model's local directory, as the shared vLLM engine serves it."""
    from psrl.models import model_dir

    return str(model_dir("tiny-qwen2"))


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
