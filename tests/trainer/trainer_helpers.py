"""Shared pieces of the trainer tests: fixed batches and the multi-process worker."""

from __future__ import annotations

import hashlib
import warnings

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class DeviceReads(TorchDispatchMode):
    """Counts the host's reads of tensor values in a block: scalar reads (``.item()``, ``int(t)``,
    ``float(t)``) and copies from a device to the host. On CUDA each one waits for everything
    queued on the GPU before it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func is aten._local_scalar_dense.default:
            self.count += 1
        elif func is aten._to_copy.default and args[0].device.type != "cpu":
            self.count += torch.device(kwargs.get("device") or args[0].device).type == "cpu"
        elif func is aten.copy_.default and args[0].device.type == "cpu" and args[1].device.type != "cpu":
            self.count += 1
        return func(*args, **kwargs)


def reads_per_step(device: str, dtype: str) -> dict[int, int]:
    """Host reads of the tiny model's second decoupled-PPO step with a reference model (so the
    proximal and reference forward-only passes run too), by the step's number of micro-batches
    (1 and more than 2). Checks on the way that ``compute_logprobs`` gives one value per response
    token. The counts should be equal: none inside the micro-batch loop."""
    from psrl.config import AlgorithmConfig, TrainerConfig
    from psrl.models import model_dir
    from psrl.trainer.trainer import MegatronTrainer

    trajs = make_trajectories(6)
    algo = AlgorithmConfig(loss="decoupled_ppo", kl_coef=0.5, kl_estimator="k3")
    reads: dict[int, int] = {}
    for budget in (4096, 24):
        cfg = TrainerConfig(device=device, dtype=dtype, micro_batch_tokens=budget)
        with MegatronTrainer(str(model_dir("tiny-qwen2")), cfg, algo) as tr:
            for t, lp in zip(trajs, tr.compute_logprobs(trajs), strict=True):
                assert lp.shape == (len(t.response_ids),) and np.isfinite(lp).all()
                t.logprobs = lp
            tr.step(trajs)  # first use: tables, buffers
            with DeviceReads() as mode:
                m = tr.step(trajs)
            assert np.isfinite(m["loss"]), m
            reads[int(m["micro_batches"])] = mode.count
    assert len(reads) == 2 and max(reads) > 2, reads
    assert len(set(reads.values())) == 1, reads
    return reads


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


def tp_worker(rank: int, path: str, tp: int, pp: int, dp: int, out_path: str, steps: int, gae: bool = False,
              lora_rank: int = 0) -> None:
    """One rank of a multi-process run: log-probs, ``steps`` steps, then the exported HF weights.
    ``gae``: PPO with a critic and one-group mini-batches (two optimizer steps a batch).
    ``lora_rank``: LoRA adapters of that rank on every projection (exported merged)."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from psrl.config import AlgorithmConfig, LoraConfig, OptimConfig, ParallelConfig, TrainerConfig
    from psrl.trainer.trainer import MegatronTrainer

    cfg = TrainerConfig(
        micro_batch_tokens=40, device="cpu", parallel=ParallelConfig(tensor=tp, pipeline=pp, data=dp),
        optim=OptimConfig(lr=1e-2 if lora_rank else 1e-3, clip_grad=1.0), ppo_mini_batch_size=1 if gae else None,
        lora=LoraConfig(rank=lora_rank, init="gaussian"),
    )
    algo = AlgorithmConfig(loss="decoupled_ppo", advantage="gae" if gae else "grpo", gamma=0.9, lam=0.8)
    with MegatronTrainer(path, cfg, algo) as tr:
        batch = make_trajectories()
        logprobs = tr.compute_logprobs(batch)
        metrics = [tr.step(batch) for _ in range(steps)]
        state = tr.hf_state_dict()
        if rank == 0:
            torch.save({"logprobs": logprobs, "metrics": metrics, "state": state}, out_path)
