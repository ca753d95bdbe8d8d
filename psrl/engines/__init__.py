"""Inference engines: the ``InferenceEngine`` seam, vLLM replicas and the ``Router``."""

from .base import EngineStatistics, FinishReason, GenerateRequest, GenerateResult, InferenceEngine, SamplingParams

__all__ = ["EngineStatistics", "FinishReason", "GenerateRequest", "GenerateResult", "InferenceEngine", "SamplingParams"]
