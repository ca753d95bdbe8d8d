"""Full logits of one model from transformers and from PSRL's Megatron trainer, on the same
token ids, laid out position by position so the two compare directly (``psrl models check``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

SEQUENCE_LENGTHS = (40, 64)  # the fixed random sequences the logits are compared on


def fixed_sequences(vocab_size: int, seed: int = 0) -> list[np.ndarray]:
    """The random token ids (int64) every logit comparison runs on."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, n).astype(np.int64) for n in SEQUENCE_LENGTHS]


def megatron_logits(trainer: Any, seqs: list[np.ndarray], mode: str) -> list[np.ndarray]:
    """The trainer's full (T, V) float32 logits of each sequence, from one micro-batch of all of
    them laid out as the trainer lays them out (``mode``: packed or padded). Outside
    ``scoring_rows`` the output layer projects every position; at tensor parallel 1 the
    vocabulary-parallel logits are the whole vocabulary."""
    import torch

    from psrl.trainer.batch import Sample, build_micro_batch

    if trainer.layout.tp != 1 or trainer.layout.pp != 1:
        raise ValueError("full logits are read at tensor and pipeline parallel 1 only")
    samples = [Sample(key=f"s{i}", group_id="g", reward=0.0, prompt_ids=s[:1].astype(np.int32),
                      response_ids=s[1:].astype(np.int32), loss_mask=np.ones(len(s) - 1, np.int8),
                      logprobs=np.zeros(len(s) - 1, np.float32), versions=np.zeros(len(s) - 1, np.int32))
               for i, s in enumerate(seqs)]
    mb = build_micro_batch(samples, range(len(samples)), mode)
    model, was_training = trainer.model, trainer.model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params()).float()
    finally:
        model.train(was_training)
    bounds = mb.cu_seqlens.tolist()
    if mode == "packed":
        return [out[0, bounds[i]:bounds[i + 1]].numpy() for i in range(len(seqs))]
    return [out[i, :len(s)].numpy() for i, s in enumerate(seqs)]


def hf_logits(model_dir: str | Path, seqs: list[np.ndarray]) -> list[np.ndarray]:
    """transformers' (T, V) float32 logits of each sequence on its own (eager attention)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return [hf(torch.from_numpy(s)[None]).logits[0].float().numpy() for s in seqs]


def max_abs_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """The largest |a - b| over pairs of same-shaped arrays."""
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape:
            raise ValueError(f"logits of shape {x.shape} against {y.shape}")
    return float(max(np.abs(x - y).max() for x, y in zip(a, b, strict=True)))
