"""Shared pieces of the packed-attention tests: long packed batches, HF per-sequence log-probs and
the multi-process worker (module level, so spawned ranks can import it)."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from psrl.trajectory import Trajectory

# Lengths chosen so that packed micro-batches hold several documents, some of one length next to
# each other (one SDPA call for the run) and some alone.
LENGTHS = [(7, 41), (7, 41), (5, 30), (12, 19), (3, 60), (9, 9), (9, 9), (4, 77)]


def packed_trajectories(vocab: int = 800, seed: int = 0) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    out = []
    for i, (p, r) in enumerate(LENGTHS):
        mask = np.ones(r, np.int8)
        mask[r // 3 : r // 3 + 2] = 0  # an observation span
        out.append(
            Trajectory(
                key=f"p{i}", group_id=f"g{i // 2}", prompt_ids=rng.integers(0, vocab, p),
                response_ids=rng.integers(0, vocab, r), loss_mask=mask,
                logprobs=np.where(mask == 1, -6.0, 0.0).astype(np.float32), versions=np.zeros(r, np.int64),
                turn_bounds=[[0, r]], turn_rewards=[float(i % 2)], reward=float(i % 2),
            )
        )
    return out


def hf_model(path, attn_implementation: str | None = None):
    """A transformers model in float32, in eval mode (``attn_implementation`` as transformers names it)."""
    from transformers import AutoModelForCausalLM

    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


@torch.no_grad()
def hf_logprobs(hf, trajs) -> list[np.ndarray]:
    """Each sequence through ``hf`` on its own (no packing, no padding): response log-probs, 0
    where the loss mask is 0."""
    out = []
    for t in trajs:
        ids = torch.from_numpy(np.concatenate([t.prompt_ids, t.response_ids]).astype(np.int64))[None]
        logp = torch.log_softmax(hf(ids).logits[0].float(), -1)
        p = len(t.prompt_ids)
        out.append(logp[p - 1 : -1].gather(-1, ids[0, p:, None])[:, 0].numpy() * t.loss_mask)
    return out


def hf_logprobs_alone(path: str, trajs) -> list[np.ndarray]:
    """Each sequence through a plain transformers forward on its own (no packing, no padding)."""
    return hf_logprobs(hf_model(path), trajs)


def packed_worker(rank: int, path: str, tp: int, pp: int, budget: int, out_path: str) -> None:
    """One rank: log-probs of the packed batch under tensor/pipeline parallelism."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from psrl.config import ParallelConfig, TrainerConfig
    from psrl.trainer.trainer import MegatronTrainer

    cfg = TrainerConfig(micro_batch_tokens=budget, device="cpu", parallel=ParallelConfig(tensor=tp, pipeline=pp))
    with MegatronTrainer(path, cfg) as tr:
        logprobs = tr.compute_logprobs(packed_trajectories())
        if rank == 0:
            torch.save(logprobs, out_path)
