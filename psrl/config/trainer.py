from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class OptimConfig(Section):
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = Field(1.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"


class ParallelConfig(Section):
    tensor: int = Field(1, ge=1)
    pipeline: int = Field(1, ge=1)
    data: int = Field(1, ge=1)


class TrainerConfig(Section):
    mode: Literal["sync", "one_step_off", "async"] = "sync"
    placement: Literal["colocated", "separate"] = "colocated"
    total_steps: int = Field(10, ge=1)
    eval_every: int = Field(0, ge=0)  # 0 = never
    save_every: int = Field(0, ge=0)
    resume: bool = False
    checkpoint_dir: str = "runs/default/checkpoints"
    micro_batch_tokens: int = Field(4096, ge=16)  # dynamic batching budget per micro-batch
    max_failure_rate: float = Field(0.5, ge=0, le=1)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    optim: OptimConfig = OptimConfig()
    parallel: ParallelConfig = ParallelConfig()


class AlgorithmConfig(Section):
    advantage: Literal["grpo", "rloo", "reinforce_pp"] = "grpo"
    norm_adv_by_std: bool = True
    loss: Literal["ppo", "decoupled_ppo"] = "ppo"
    clip_ratio_low: float = Field(0.2, ge=0)
    clip_ratio_high: float = Field(0.28, ge=0)
    dual_clip_c: float | None = 3.0  # None disables dual clip
    tis_cap: float | None = 2.0  # truncated importance sampling cap for rollout/trainer mismatch
    kl_coef: float = Field(0.0, ge=0)  # > 0 needs a reference model
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = 0.0
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
