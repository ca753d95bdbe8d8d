"""The value model of PPO with a critic (``algorithm.advantage=gae``).

It is the policy's Megatron GPTModel build (from ``critic.model.path``, by default the policy's
checkpoint) with the output layer replaced by a scalar head ``Linear(hidden, 1)``, zero-initialized
and not tied to the embeddings; it lives on the same ranks with the same tensor/pipeline/data
layout as the policy, has its own optimizer and LR schedule, and is saved in the policy's
checkpoints. Only the tokenizer must match the policy's (same vocabulary size); the hidden size
and depth may differ.

The value at a position is that of the state before the next token, i.e. it is read where the
policy's logits for the response token are (``batch``'s alignment), so ``per_response`` gives
response-aligned values.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from psrl.config.trainer import CriticConfig
from psrl.models import resolve_model_path

from .batch import MicroBatch, Sample, per_response
from .distributed import wrap_ddp
from .gae import gae, token_rewards, whiten, whiten_stats
from .losses import value_loss
from .model import HFArch, build_gpt_model, transformer_config
from .optim import build_optimizer, optimizer_step, use_fused_adam
from .weights import load_hf_weights

if TYPE_CHECKING:
    from .trainer import MegatronTrainer


class ValueHead(torch.nn.Module):
    """GPTModel's ``output_layer`` slot: hidden states (s, b, h) -> values (s, b, 1)."""

    def __init__(self, hidden: int, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.value = torch.nn.Linear(hidden, 1, dtype=dtype, device=device)
        torch.nn.init.zeros_(self.value.weight)
        torch.nn.init.zeros_(self.value.bias)

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        return self.value(hidden_states), None


class Critic:
    def __init__(self, trainer: MegatronTrainer, cfg: CriticConfig) -> None:
        from megatron.core import parallel_state as ps

        self.tr, self.cfg = trainer, cfg
        self.hf_dir = resolve_model_path(cfg.model.path) if cfg.model.path else trainer.hf_dir
        self.arch = HFArch.from_pretrained(self.hf_dir)
        if self.arch.vocab_size != trainer.arch.vocab_size:
            raise ValueError(
                f"critic.model.path={cfg.model.path}: vocabulary of {self.arch.vocab_size} tokens, the policy's has "
                f"{trainer.arch.vocab_size}; the critic reads the policy's token ids, so its tokenizer must be the policy's"
            )
        tc = trainer.cfg
        p = tc.parallel
        if self.hf_dir == trainer.hf_dir:
            config = trainer.tconfig
        else:
            config = transformer_config(self.arch, tp=p.tensor, pp=p.pipeline, dtype=tc.dtype, device=trainer.device,
                                        recompute=tc.recompute, ep=p.expert, aux_loss_coef=tc.moe.aux_loss_coef)
            config.finalize_model_grads_func = trainer.tconfig.finalize_model_grads_func
        last = ps.is_pipeline_last_stage()
        with trainer._megatron_call():
            module = build_gpt_model(self.arch, config, pre_process=ps.is_pipeline_first_stage(), post_process=last,
                                     tie_embeddings=False)
        if trainer.device == "cuda":
            module.cuda(torch.cuda.current_device())
        load_hf_weights(module, self.hf_dir, self.arch)
        self.lora = tc.lora.rank > 0
        if self.lora:  # the backbone frozen with adapters of its own; the value head trains whole
            from .lora import apply_lora

            apply_lora(module, self.arch, tc.lora, seed=tc.seed + 1)
        if last:
            device = "cuda" if trainer.device == "cuda" else "cpu"
            module.output_layer = ValueHead(self.arch.hidden_size, config.params_dtype, device)
        self.model = wrap_ddp(config, module)
        self.optimizer, self.scheduler = build_optimizer(
            self.model, cfg.optim, dtype=tc.dtype, params_dtype=config.params_dtype, device=trainer.device,
            total_steps=tc.total_steps,
        )

    def values(self, samples: Sequence[Sample], indices: Sequence[int]) -> dict[int, np.ndarray]:
        """Response-aligned values of ``indices`` (0 where the loss mask is 0) on the last pipeline
        stage; {} on the others."""
        if not indices:
            return {}
        mbs = self.tr._micro_batches(samples, indices)

        def read(mb, out):
            v = out[..., 0].float()
            return v.sum() * 0.0, {"v": (v * mb.loss_mask.to(v.device)).detach()}  # to the host once, after the loop (_forward_only)

        per_mb = self.tr._forward_only(self.model, mbs, read, "v")
        result: dict[int, np.ndarray] = {}
        for mb, v in zip(mbs, per_mb or []):
            result.update(per_response(mb, samples, v))
        return result

    def advantages(self, samples: Sequence[Sample], local: list[int]):
        """Values, GAE advantages (whitened over the batch's trained tokens) and returns of the
        ``local`` samples, plus the critic's batch metrics (last pipeline stage; empty elsewhere)."""
        tr, algo = self.tr, self.tr.algo
        values = self.values(samples, local)
        if not tr.layout.is_last_stage:
            return {}, {}, {}, {}
        advs, rets, masks = {}, {}, {}
        for i in local:
            s = samples[i]
            r = token_rewards(s.loss_mask, s.reward, s.turn_bounds, s.turn_rewards, use_turns=algo.turn_rewards)
            advs[i], rets[i] = gae(r, values[i], s.loss_mask, algo.gamma, algo.lam)
            masks[i] = s.loss_mask.astype(bool)
        ret_all = np.concatenate([rets[i][masks[i]] for i in local] or [np.zeros(0)])
        res_all = ret_all - np.concatenate([values[i][masks[i]] for i in local] or [np.zeros(0)])
        val_all = ret_all - res_all
        sums = tr._dp_sum([
            *whiten_stats([advs[i] for i in local], [masks[i] for i in local]),
            ret_all.sum(), np.square(ret_all).sum(), res_all.sum(), np.square(res_all).sum(), val_all.sum(),
            sum(np.abs(advs[i][masks[i]]).sum() for i in local),
        ])
        n = max(sums[0], 1.0)
        var = lambda s1, s2: max(s2 / n - (s1 / n) ** 2, 0.0)  # noqa: E731
        var_ret = var(sums[3], sums[4])
        metrics = {
            "critic/explained_var": float(1.0 - var(sums[5], sums[6]) / var_ret) if var_ret > 1e-12 else 0.0,
            "critic/value_mean": float(sums[7] / n),
            "critic/return_mean": float(sums[3] / n),
            "adv_mean": float(sums[1] / n),
            "adv_abs_mean": float(sums[8] / n),  # before whitening, over the batch's trained tokens
        }
        adv_tok = {i: whiten(advs[i], masks[i], sums[:3], algo.norm_adv_by_std) for i in local}
        return adv_tok, values, {i: rets[i].astype(np.float32) for i in local}, metrics

    def train_step(self, mbs: list[MicroBatch], schedule_start: float, done: int, total: int) -> dict[str, float]:
        """One optimizer step on a mini-batch whose micro-batches carry ``old_values``, ``returns``
        and ``weight`` extras; returns the mini-batch's (data-parallel reduced) metrics."""
        from .optim import advance_schedule

        tr = self.tr
        self.optimizer.zero_grad()  # before the buffers: they make each fp32 param.grad a view of its buffer
        self.model.zero_grad_buffer()
        scale = len(mbs) * tr.layout.dp
        out = tr._run(self.model, mbs, partial(self._loss_fn, scale), forward_only=False)
        ok, grad_norm = optimizer_step(self.optimizer, self.model, clip_grad=self.cfg.optim.clip_grad,
                                       device=tr.device, mp_group=tr._mp_group, expert_group=tr._expert_group)
        advance_schedule(self.scheduler, schedule_start, done, total)
        metrics = tr._reduce_metrics(out, broadcast=False)
        metrics.update(grad_norm=grad_norm, update_ok=float(ok))
        return metrics

    def _loss_fn(self, scale: int, mb: MicroBatch, out: torch.Tensor):
        x = {k: v.to(out.device) for k, v in mb.extras.items()}
        terms = value_loss(out[..., 0].float(), x["old_values"], x["returns"], x["weight"], self.cfg.value_clip)
        return terms.loss * scale, {k: v.detach().float() for k, v in terms.metrics.items()}  # read once, when reduced

    def state_dict(self) -> dict:
        from .lora import trainable_state

        model = trainable_state(self.model) if self.lora else self.model.module.state_dict()
        return {"model": model, "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.lora:
            from .lora import load_trainable_state

            load_trainable_state(self.model, state["model"], "the critic")
        else:
            self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        use_fused_adam(self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
