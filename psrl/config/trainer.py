from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from .base import Section


class OptimConfig(Section):
    lr: float = Field(1e-5, gt=0)
    min_lr: float = Field(0.0, ge=0)  # floor of the cosine / linear decay
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = Field(1.0, ge=0)  # 0 disables clipping
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"


class ParallelConfig(Section):
    tensor: int = Field(1, ge=1)
    pipeline: int = Field(1, ge=1)
    data: int = Field(1, ge=1)
    # Expert parallel (mixture-of-experts models): each layer's experts are spread over this many
    # data-parallel ranks (it divides ``data``); dense layers stay data-parallel.
    expert: int = Field(1, ge=1)


class MoEConfig(Section):
    """Mixture-of-experts training (Qwen3-MoE); ignored by dense models."""

    # The router's load-balancing (auxiliary) loss coefficient; None: the checkpoint's own
    # (``router_aux_loss_coef``, 0.001 for Qwen3-MoE); 0 turns the loss off.
    aux_loss_coef: float | None = Field(None, ge=0)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(Section):
    """Low-rank adapters (``rank`` > 0): the base model stays frozen in its dtype and only the
    adapters train; the engines serve them as vLLM LoRA adapters (``psrl.trainer.lora``)."""

    rank: int = Field(0, ge=0)  # 0: full-parameter training
    alpha: float = Field(16.0, gt=0)  # the update is scaled by alpha / rank
    dropout: float = Field(0.0, ge=0, lt=1)  # on the adapters' input, in training only
    # PEFT's names; "all-linear": every projection of the attention and of a dense MLP.
    target_modules: list[str] = ["all-linear"]
    # "kaiming": PEFT's default (A kaiming-uniform, B zero); "gaussian": A ~ N(0, 1/rank), B zero.
    # Either way the adapted model starts as the base model.
    init: Literal["kaiming", "gaussian"] = "kaiming"
    # Merge the adapters into the base and sync full weights (engines that cannot serve adapters).
    merge_for_rollout: bool = False

    @field_validator("target_modules")
    @classmethod
    def _known_targets(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("trainer.lora.target_modules is empty")
        unknown = [t for t in v if t not in LORA_TARGETS and t != "all-linear"]
        if unknown:
            raise ValueError(f"unknown trainer.lora.target_modules {unknown}; known: {', '.join(LORA_TARGETS)}, all-linear")
        return v

    def targets(self) -> tuple[str, ...]:
        """The PEFT projection names adapted, in their fixed order."""
        return LORA_TARGETS if "all-linear" in self.target_modules else tuple(t for t in LORA_TARGETS if t in self.target_modules)


class TrainerConfig(Section):
    mode: Literal["sync", "one_step_off", "async"] = "sync"
    placement: Literal["colocated", "separate"] = "colocated"
    total_steps: int = Field(10, ge=1)
    eval_every: int = Field(0, ge=0)  # 0 = never
    save_every: int = Field(0, ge=0)
    resume: bool = False
    checkpoint_dir: str = "runs/default/checkpoints"
    # The policy to train; None = the rollout model (gen_actor_rollout_ref.model.path).
    model_path: str | None = None
    # Parameter dtype. On CPU only float32 trains (Megatron's mixed-precision optimizer is CUDA-only).
    dtype: Literal["float32", "bfloat16"] = "float32"
    # "packed": sequences are concatenated into one row per micro-batch; attention stays inside each
    # sequence through its bounds (cu_seqlens), no mask is built;
    # "padded": sequences sorted by length are padded to the longest of their micro-batch.
    # Both fill a micro-batch up to micro_batch_tokens.
    batching: Literal["packed", "padded"] = "packed"
    micro_batch_tokens: int = Field(4096, ge=16)  # dynamic batching budget per micro-batch
    # Activation recompute for long micro-batches: "full" keeps one tensor per layer and recomputes
    # the layer in backward (~1/3 more compute); "selective" recomputes the MLP only.
    recompute: Literal["none", "selective", "full"] = "none"
    max_failure_rate: float = Field(0.5, ge=0, le=1)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # On CPU, keep freed memory in the process for the next step: glibc otherwise serves every
    # block over 32 MB (logits, the embedding gradient) with a fresh mapping and returns the top of
    # the heap to the OS, and the next step page-faults it all back (SmolLM2: ~0.3-0.8 M faults,
    # ~5-10% of a step). The process keeps its peak RSS instead. Process-wide (mallopt).
    cpu_keep_freed_memory: bool = True
    # At the end of `psrl train`, write the final policy as a Hugging Face directory to
    # OUTPUT_DIR/hf (what `psrl export` writes).
    export_hf: bool = False
    # PPO mini-batches: each batch is split into mini-batches of this many groups (prompts, as veRL
    # counts them), whole groups kept, one optimizer step each; None = the whole batch, one step.
    # The proximal policy's log-probs (decoupled_ppo) are taken once per batch, before the first
    # mini-batch, so the clip and the TIS correction act from the second mini-batch on.
    ppo_mini_batch_size: int | None = Field(None, ge=1)
    ppo_epochs: int = Field(1, ge=1)  # passes over the batch: ppo_epochs * mini-batches optimizer steps
    optim: OptimConfig = OptimConfig()
    parallel: ParallelConfig = ParallelConfig()
    moe: MoEConfig = MoEConfig()
    lora: LoraConfig = LoraConfig()


class AlgorithmConfig(Section):
    # "gae": PPO with a critic (the ``critic`` section): per-token advantages by generalized
    # advantage estimation over the trained tokens, whitened over the batch.
    advantage: Literal["grpo", "rloo", "reinforce_pp", "gae"] = "grpo"
    norm_adv_by_std: bool = True
    gamma: float = Field(1.0, ge=0, le=1)  # GAE discount, per trained token
    lam: float = Field(1.0, ge=0, le=1)  # GAE lambda
    # GAE rewards: each turn's reward on the turn's last token (when the trajectory has per-turn
    # rewards), else the final reward on the last trained token.
    turn_rewards: bool = False
    # "ppo": ratio against the rollout's (behaviour) log-probs, no extra forward pass.
    # "decoupled_ppo": proximal log-probs are recomputed by the trainer before the update; the
    # ratio is taken against them and the behaviour policy is corrected by importance weights
    # pi_prox / pi_behav (staleness and rollout/trainer mismatch), capped at ``tis_cap``.
    loss: Literal["ppo", "decoupled_ppo"] = "ppo"
    clip_ratio_low: float = Field(0.2, ge=0)
    clip_ratio_high: float = Field(0.28, ge=0)
    dual_clip_c: float | None = Field(3.0, gt=1.0)  # None disables dual clip
    tis_cap: float | None = Field(2.0, gt=0)  # truncated importance sampling cap (decoupled_ppo)
    # "truncate": weight = min(w, cap); "mask": tokens with w > cap get no gradient.
    tis_mode: Literal["truncate", "mask"] = "truncate"
    kl_coef: float = Field(0.0, ge=0)  # > 0 builds a frozen reference model
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = 0.0
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    # Mixture of experts: the trainer routes each token to the experts the engine routed it to
    # (recorded per token in the trajectory's ``routed_experts``), so both compute the same
    # function; tokens without a record are routed by the trainer's own router.
    router_replay: bool = False


class CriticModelConfig(Section):
    path: str | None = None  # None = the policy's model (trainer.model_path, else the rollout model)


class CriticConfig(Section):
    """The value model of ``algorithm.advantage=gae``: the policy's architecture with its output
    layer replaced by a scalar head, trained in the same Megatron job as the policy (same ranks and
    parallel layout), its own optimizer, checkpointed with the policy."""

    model: CriticModelConfig = CriticModelConfig()
    # 1e-3: on the quickstart 1e-4 left the value at 0.15 while returns reached 0.98 (README)
    optim: OptimConfig = OptimConfig(lr=1e-3)
    value_clip: float | None = Field(0.5, gt=0)  # clip of the new value around the old one; None: no clip
