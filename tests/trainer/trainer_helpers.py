"""Shared pieces of the trainer tests: fixed batches and the multi-process worker."""

from __future__ import annotations

import hashlib
import warnings

import numpy as np
import torch

from psrl.trajectory import Trajectory


def make_trajectories(n: int = 6, *, seed: int = 0, vocab: int = 800, group_size: int = 3, obs: bool = True) -> list[Trajectory]:
    """Random prompts and responses; odd responses carry an observation span (loss mask 0)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = rng.integers(0, vocab, 3 + i % 4)
        r = rng.integers(0, vocab, 5 + (3 * i) % 7)
        mask = np.ones(len(r), np.int8)
        if obs and i % 2:
            mask[2:4] = 0
        lp = np.where(mask == 1, rng.uniform(-8, -5, len(r)), 0).astype(np.float32)
        ver = np.where(mask == 1, 0, -1)
        out.append(
            Trajectory(
                key=f"k{i}", group_id=f"g{i // group_size}", prompt_ids=p, response_ids=r, loss_mask=mask,
                logprobs=lp, versions=ver, turn_bounds=[[0, len(r)]], turn_rewards=[float(i % 3 == 0)],
                reward=float(i % 3 == 0) + 0.1 * i,
            )
        )
    return out


def tensor_digest(t: torch.Tensor) -> str:
    """dtype, shape and a hash of the raw bytes: equal digests mean bit-identical tensors."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{t.dtype}:{tuple(t.shape)}:{hashlib.sha256(raw).hexdigest()}"


def build_random_hf(out, family: str, *, tied: bool, seed: int = 0) -> str:
    """A random Qwen2 or Llama with 2 key/value heads (so tensor parallel 2 can split it)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cls, config_cls = (Qwen2ForCausalLM, Qwen2Config) if family == "qwen2" else (LlamaForCausalLM, LlamaConfig)
    config = config_cls(
        vocab_size=832, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=tied, rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    cls(config).save_pretrained(out, safe_serialization=True)
    return str(out)


def tp_worker(rank: int, path: str, tp: int, pp: int, dp: int, out_path: str, steps: int, gae: bool = False) -> None:
    """One rank of a multi-process run: log-probs, ``steps`` steps, then the exported HF weights.
    ``gae``: PPO with a critic and one-group mini-batches (two optimizer steps a batch)."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from psrl.config import AlgorithmConfig, OptimConfig, ParallelConfig, TrainerConfig
    from psrl.trainer.trainer import MegatronTrainer

    cfg = TrainerConfig(
        micro_batch_tokens=40, device="cpu", parallel=ParallelConfig(tensor=tp, pipeline=pp, data=dp),
        optim=OptimConfig(lr=1e-3, clip_grad=1.0), ppo_mini_batch_size=1 if gae else None,
    )
    algo = AlgorithmConfig(loss="decoupled_ppo", advantage="gae" if gae else "grpo", gamma=0.9, lam=0.8)
    with MegatronTrainer(path, cfg, algo) as tr:
        batch = make_trajectories()
        logprobs = tr.compute_logprobs(batch)
        metrics = [tr.step(batch) for _ in range(steps)]
        state = tr.hf_state_dict()
        if rank == 0:
            torch.save({"logprobs": logprobs, "metrics": metrics, "state": state}, out_path)
