"""One supervised step on ``MegatronTrainer``: the same micro-batches (packed with ``cu_seqlens``
or padded), forward-backward schedule, optimizer step and LR schedule as a policy step, with
cross-entropy on the loss-mask tokens averaged over all loss tokens of the batch."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .batch import MicroBatch, Sample, shard_for_rank, to_samples
from .logprobs import vocab_parallel_argmax_hits, vocab_parallel_logprobs
from .losses import sft_loss

if TYPE_CHECKING:
    from .trainer import MegatronTrainer


def _loss_fn(scale: int, mb: MicroBatch, logits: torch.Tensor):
    dev = logits.device
    targets = mb.at_scored(mb.targets.to(dev))  # the logits are the scored positions' only
    logp, _ = vocab_parallel_logprobs(logits, targets)  # temperature 1: the model's own distribution
    terms = sft_loss(logp, vocab_parallel_argmax_hits(logits.detach(), targets), mb.at_scored(mb.extras["weight"].to(dev)))
    # The schedule divides the returned tensor in place: hand it a fresh one.
    return terms.loss * scale, {k: v.detach().float() for k, v in terms.metrics.items()}  # read once, when reduced


def sft_step(trainer: MegatronTrainer, batch: Sequence[Sample]) -> dict[str, float]:
    """Every rank passes the whole batch and trains its data-parallel share. Metrics (identical
    on every rank): ``loss``, ``token_acc`` (greedy prediction = target, on loss tokens), ``lr``
    (the rate this step used), ``tokens_per_s``, ``grad_norm``."""
    t0 = time.perf_counter()
    samples = to_samples(batch, trainer.arch.vocab_size)
    lay = trainer.layout
    if len(samples) < lay.dp:
        raise ValueError(f"a batch of {len(samples)} samples cannot be split over {lay.dp} data-parallel ranks")
    total_tokens = sum(s.num_loss_tokens for s in samples)
    if total_tokens == 0:
        raise ValueError("an SFT batch without loss tokens")
    mbs = trainer._micro_batches(samples, shard_for_rank(samples, lay.dp, lay.dp_rank))
    for mb in mbs:
        mb.extras["weight"] = mb.loss_mask / total_tokens
    lr = float(trainer.optimizer.param_groups[0]["lr"])
    metrics = trainer._optimizer_step(mbs, trainer.scheduler.num_steps, 1, 1, loss_fn=_loss_fn)
    metrics = trainer._from_last_stage(metrics)
    trainer.version += 1
    trainer.step_count += 1
    trainer.optimizer_steps += 1
    elapsed = time.perf_counter() - t0
    tokens = sum(s.seq_len for s in samples)
    metrics.update(
        lr=lr, samples=float(len(samples)), loss_tokens=float(total_tokens), tokens=float(tokens),
        step_s=elapsed, tokens_per_s=tokens / elapsed, version=float(trainer.version),
    )
    return metrics
