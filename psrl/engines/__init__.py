"""Inference engines: the ``InferenceEngine`` seam, vLLM replicas and the ``Router``.

vLLM itself is imported only when an engine starts.
"""

from .base import EngineStatistics, FinishReason, GenerateRequest, GenerateResult, InferenceEngine, SamplingParams
from .factory import create_engine, make_engine, open_engine, sampling_from_config
from .router import Router
from .vllm_engine import VLLMEngine

__all__ = [
    "EngineStatistics",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "InferenceEngine",
    "Router",
    "SamplingParams",
    "VLLMEngine",
    "create_engine",
    "make_engine",
    "open_engine",
    "sampling_from_config",
]
