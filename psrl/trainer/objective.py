"""The policy's objective on micro-batches, and what a training step reports.

``attach_policy_inputs`` puts on each micro-batch of a mini-batch the per-position tensors the
loss reads (advantages, the behaviour policy's log-probs, the loss-aggregation weights, and the
proximal / reference log-probs and the critic's targets where the algorithm has them), aligned to
the micro-batch's packed positions. ``policy_loss_fn`` is the loss Megatron's schedule calls with
a micro-batch's logits. ``step_metrics`` are the batch-level figures of ``MegatronTrainer.step``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from psrl.config import AlgorithmConfig
from psrl.trajectory import NO_VERSION

from .batch import MicroBatch, Sample, per_position
from .logprobs import vocab_parallel_logprobs
from .losses import LOG_RATIO_LIMIT, aggregation_weights, behaviour_weights, policy_loss

PerSample = Mapping[int, np.ndarray]  # sample index -> one value per response token


def attach_policy_inputs(
    mbs: Sequence[MicroBatch], samples: Sequence[Sample], adv_tok: PerSample, optional: Mapping[str, PerSample],
    loss_agg: str, total_tokens: int, total_seqs: int, *, dummy: bool,
) -> None:
    """Set ``mb.extras`` of every micro-batch. ``optional`` (name -> per-sample arrays) are added
    only where not empty; a sample missing from a mapping counts as zeros. ``total_*`` are the
    mini-batch's loss-token and sequence counts over every data-parallel rank; ``dummy`` (a rank
    with no sample in the mini-batch) zeroes the weights, so the rank steps without effect."""
    seq_tokens = torch.tensor([s.num_loss_tokens for s in samples], dtype=torch.float32)
    zeros = [np.zeros(len(s.response_ids), np.float32) for s in samples]

    def spread(mb: MicroBatch, d: PerSample) -> torch.Tensor:
        return per_position(mb, samples, [d.get(i, zeros[i]) for i in range(len(samples))])

    token_w = 1.0 / max(total_tokens, 1)
    for mb in mbs:
        mb.extras["adv"] = spread(mb, adv_tok)
        mb.extras["behav_logp"] = per_position(mb, samples, [s.logprobs for s in samples])
        mb.extras["token_weight"] = mb.loss_mask * (0.0 if dummy else token_w)  # the rollout metrics' token mean
        per_seq = seq_tokens[mb.sample_index.clamp(min=0)] if loss_agg == "seq_mean" else None
        w = aggregation_weights(mb.loss_mask, per_seq, loss_agg, total_tokens, total_seqs)
        mb.extras["weight"] = w * 0.0 if dummy else w
        for key, d in optional.items():
            if d:
                mb.extras[key] = spread(mb, d)


def policy_loss_fn(algo: AlgorithmConfig, temperature: float, scale: int, mb: MicroBatch, logits: torch.Tensor):
    """(loss * ``scale``, metric tensors) of one micro-batch from its logits and its extras."""
    dev = logits.device
    x = {k: mb.at_scored(v.to(dev)) for k, v in mb.extras.items()}
    logp, entropy = vocab_parallel_logprobs(
        logits, mb.at_scored(mb.targets.to(dev)), temperature=temperature, with_entropy=True,
        entropy_grad=algo.entropy_coef != 0, reuse_logits=True,  # read no more here
    )
    behav_weight = None
    if algo.loss == "decoupled_ppo":
        old = x["prox_logp"]
        behav_weight = behaviour_weights(old, x["behav_logp"], algo.tis_cap, algo.tis_mode)
    else:
        old = x["behav_logp"]
    terms = policy_loss(
        logp, old, x["adv"], x["weight"], algo,
        behav_weight=behav_weight, ref_logp=x.get("ref_logp"), entropy=entropy,
    )
    terms.metrics.update(rollout_agreement(x.get("prox_logp", logp), x["behav_logp"], x["token_weight"]))
    # The schedule divides the returned tensor in place: hand it a fresh one. The metrics stay
    # on the device until the trainer reduces them (a read per micro-batch would stall a GPU).
    return terms.loss * scale, {k: v.detach().float() for k, v in terms.metrics.items()}


# Metrics reduced by their maximum (over micro-batches, data-parallel ranks and optimizer steps),
# not summed; see ``MegatronTrainer._reduce_metrics``.
MAX_METRICS = ("rollout_logprob_abs_diff_max",)
# Metrics of the policy before this step's first update: taken from the first optimizer step.
FIRST_STEP_METRICS = ("rollout_logprob_abs_diff", "rollout_logprob_abs_diff_max", "rollout_kl")


@torch.no_grad()
def rollout_agreement(trainer_logp: torch.Tensor, behav_logp: torch.Tensor, token_weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the engine's log-probs of its sampled tokens are from the trainer's (the weighted
    sums make token means over the mini-batch): the mean and max absolute difference, and the k3
    estimate of KL(behaviour || trainer) from the behaviour's own samples,
    ``exp(d) - 1 - d`` with ``d = log pi_trainer - log pi_behaviour``. Before any update of the
    step (the first mini-batch, or the proximal log-probs when recomputed) the trainer's
    log-probs are the policy the engine should have run: the difference is engine/trainer
    mismatch plus any staleness."""
    d = (trainer_logp.detach() - behav_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    trained = token_weight > 0
    return {
        "rollout_logprob_abs_diff": (d.abs() * token_weight).sum(),
        "rollout_logprob_abs_diff_max": (d.abs() * trained).amax() if d.numel() else d.new_zeros(()),
        "rollout_kl": ((d.exp() - 1.0 - d) * token_weight).sum(),
    }


def step_metrics(samples: Sequence[Sample], rewards: np.ndarray, adv: np.ndarray | None, version: int, elapsed: float
                 ) -> dict[str, float]:
    """Batch statistics of a step that produced policy ``version`` in ``elapsed`` seconds;
    ``adv`` (per sample) is None where a critic gives per-token advantages."""
    trained = [s for s in samples if s.num_loss_tokens]
    stale = np.concatenate([version - 1 - s.versions[(s.loss_mask == 1) & (s.versions != NO_VERSION)] for s in trained] or [np.zeros(0)])
    tokens = sum(s.seq_len for s in samples)
    out: dict[str, float] = {}
    if adv is not None:
        out.update(adv_mean=float(adv.mean()), adv_abs_mean=float(np.abs(adv).mean()))
    out.update(
        reward_mean=float(rewards.mean()),
        reward_std=float(rewards.std()),
        response_len_mean=float(np.mean([len(s.response_ids) for s in samples])),
        samples=float(len(samples)),
        loss_tokens=float(sum(s.num_loss_tokens for s in samples)),  # this share's (the whole batch unsharded)
        tokens=float(tokens),
        staleness_mean=float(stale.mean()) if len(stale) else 0.0,
        staleness_max=float(stale.max()) if len(stale) else 0.0,
        step_s=elapsed,
        tokens_per_s=tokens / elapsed,
        version=float(version),
    )
    return out
