"""Megatron-Core trainer: advantages, losses, HF<->Megatron weights, checkpoints, weight sync,
mask-free packed attention (``attention``) and chunked vocab-parallel log-probs (``logprobs``).

Pure-math modules (advantages, losses) import without Megatron; ``MegatronTrainer`` needs torch
and megatron-core.
"""

from .advantages import compute_advantages, grpo_advantages, reinforce_pp_advantages, rloo_advantages
from .batch import TRAINER_FIELDS, MicroBatch, Sample, build_micro_batch, plan_micro_batches, to_samples
from .losses import aggregate, aggregation_weights, behaviour_weights, kl_penalty, policy_loss
from .weight_sync import DirectPublisher, InProcessPublisher, SyncReport, WeightPublisher

__all__ = [
    "TRAINER_FIELDS", "DirectPublisher", "InProcessPublisher", "MegatronTrainer", "MicroBatch", "Sample", "SyncReport",
    "WeightPublisher", "aggregate", "aggregation_weights",
    "behaviour_weights", "build_micro_batch", "compute_advantages", "grpo_advantages", "kl_penalty",
    "plan_micro_batches", "policy_loss", "reinforce_pp_advantages", "rloo_advantages", "to_samples",
]


def __getattr__(name: str):
    if name == "MegatronTrainer":  # imports megatron-core: only when asked for
        from .trainer import MegatronTrainer

        return MegatronTrainer
    raise AttributeError(f"module 'psrl.trainer' has no attribute {name!r}")
