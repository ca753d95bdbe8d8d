"""Megatron-Core trainer: advantages, losses, HF<->Megatron weights, checkpoints."""
