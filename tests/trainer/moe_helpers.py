"""Multi-process workers for the mixture-of-experts tests (importable by ``spawn_ranks``)."""

from __future__ import annotations

import warnings

import torch

from trainer_helpers import make_trajectories


def ep_worker(rank: int, path: str, dp: int, ep: int, out_path: str) -> None:
    """One rank: log-probs, one GRPO step, then the exported HF weights and the step's metrics.
    Adam with eps 1 moves each weight by about lr * gradient (no sign amplification of
    near-zero gradients), so the weights after the step compare the gradients."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from psrl.config import AlgorithmConfig, OptimConfig, ParallelConfig, TrainerConfig
    from psrl.trainer.trainer import MegatronTrainer

    cfg = TrainerConfig(
        micro_batch_tokens=64, device="cpu", parallel=ParallelConfig(data=dp, expert=ep),
        optim=OptimConfig(lr=1e-2, eps=1.0, clip_grad=1.0),
    )
    with MegatronTrainer(path, cfg, AlgorithmConfig()) as tr:
        batch = make_trajectories(8, vocab=800, group_size=4)
        before = {k: v.clone() for k, v in tr.hf_state_dict().items()}  # (views of the parameters where no cast is needed)
        logprobs = tr.compute_logprobs(batch)
        metrics = tr.step(batch)
        state = tr.hf_state_dict()
        if rank == 0:
            delta = {k: state[k] - before[k] for k in state}
            torch.save({"logprobs": logprobs, "metrics": metrics, "delta": delta}, out_path)
