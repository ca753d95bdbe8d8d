"""The Megatron-Core trainer: one policy (and an optional frozen reference), one ``step`` per batch.

Every rank receives the whole batch and computes advantages and loss normalizers from it (they are
global quantities); it then trains on its data-parallel share, split into micro-batches that
Megatron's forward-backward schedule runs (pipelined when pipeline parallel > 1).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist

from psrl.allocator import keep_freed_memory
from psrl.config import AlgorithmConfig, CriticConfig, TrainerConfig
from psrl.models import resolve_model_path
from psrl.trajectory import Trajectory

from . import cpu_compat
from .advantages import compute_advantages
from .batch import MicroBatch, Sample, build_micro_batch, per_response, plan_micro_batches, shard_for_rank, to_samples
from .distributed import init_parallel, resolve_device, shutdown_parallel, wrap_ddp
from .logprobs import vocab_parallel_logprobs
from .minibatch import groups_in_order, plan_mini_batches
from .model import HFArch, build_gpt_model, scoring_rows, transformer_config
from .objective import FIRST_STEP_METRICS, MAX_METRICS, attach_policy_inputs, policy_loss_fn, step_metrics
from .optim import advance_schedule, build_optimizer, megatron_call, optimizer_step
from .weights import hf_state_dict, iter_hf_weights, load_hf_weights

Batch = pa.RecordBatch | pa.Table | Sequence[Trajectory]


@dataclass(frozen=True)
class ShardTotals:
    """What a data-parallel rank stepping on its own share needs from the whole step's batch."""

    advantages: Sequence[float]  # of the share's samples, in their order (unused with GAE)
    # Of the whole step. The loss of each mini-batch is normalized by that mini-batch's counts,
    # summed over the data-parallel ranks in the step; these stay for callers and checks.
    total_tokens: int  # loss tokens
    total_seqs: int  # samples with at least one loss token


class MegatronTrainer:
    """``step(batch) -> metrics``; ``compute_logprobs(batch)``; HF-named weights for engines.

    ``temperature`` is the rollout sampling temperature: log-probs are taken from logits / T so
    they match what the engine sampled from. With ``algorithm.advantage=gae`` a critic
    (``psrl.trainer.critic``) is built beside the policy from ``critic``.
    """

    def __init__(
        self,
        model_path: str | None = None,
        config: TrainerConfig | None = None,
        algorithm: AlgorithmConfig | None = None,
        *,
        temperature: float = 1.0,
        critic: CriticConfig | None = None,
    ) -> None:
        self.cfg = config or TrainerConfig()
        self.algo = algorithm or AlgorithmConfig()
        self.critic_cfg = critic or CriticConfig()
        path = model_path or self.cfg.model_path
        if path is None:
            raise ValueError("no model: pass model_path or set trainer.model_path")
        self.hf_dir = resolve_model_path(path)
        self.arch = HFArch.from_pretrained(self.hf_dir)
        self.device = resolve_device(self.cfg.device)
        if self.device == "cpu" and self.cfg.dtype != "float32":
            raise ValueError("trainer.dtype must be float32 on CPU (Megatron's mixed-precision optimizer needs CUDA)")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)
        self.version = 0  # policy version: batches trained (plus the resumed count); weight syncs use it
        self.step_count = 0
        self.optimizer_steps = 0  # ppo_epochs * mini-batches per batch
        self._exit = contextlib.ExitStack()
        try:
            self._setup()
        except BaseException:
            self._exit.close()
            raise

    # ---- construction -----------------------------------------------------------------------

    def _setup(self) -> None:
        # Whether glibc now keeps what a step frees in this process (``trainer.cpu_keep_freed_memory``).
        self.keeps_freed_memory = self.device == "cpu" and self.cfg.cpu_keep_freed_memory and keep_freed_memory()
        with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": expected here
            warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
            from megatron.core import parallel_state as ps
            from megatron.core.distributed import finalize_model_grads
            from megatron.core.pipeline_parallel import get_forward_backward_func

        cfg, p = self.cfg, self.cfg.parallel
        on_cpu = self.device == "cpu"
        if on_cpu:
            self._exit.enter_context(cpu_compat.megatron_on_cpu())
        torch.manual_seed(cfg.seed)
        self.layout = init_parallel(p.tensor, p.pipeline, p.data, self.device, cfg.seed, ep=p.expert)
        self._exit.callback(shutdown_parallel, self.layout)
        self.tconfig = transformer_config(
            self.arch, tp=p.tensor, pp=p.pipeline, dtype=cfg.dtype, device=self.device, recompute=cfg.recompute,
            ep=p.expert, aux_loss_coef=cfg.moe.aux_loss_coef,
        )
        self.lora_params = 0  # adapter parameters on this rank
        self.model = wrap_ddp(self.tconfig, self._load_model(adapters=self.lora))
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        self.optimizer, self.scheduler = build_optimizer(
            self.model, cfg.optim, dtype=cfg.dtype, params_dtype=self.tconfig.params_dtype, device=self.device,
            total_steps=cfg.total_steps,
        )
        self.ref_model = None
        # With adapters the reference is the frozen base itself: the policy with them skipped.
        if self.algo.kl_coef > 0 and not self.lora:
            self.ref_model = self._load_model()
            self.ref_model.requires_grad_(False)
            self.ref_model.eval()
        self._fwd_bwd = get_forward_backward_func()
        self._mp_group = ps.get_model_parallel_group()
        self._expert_group = ps.get_expert_tensor_model_pipeline_parallel_group() if self.arch.num_experts else None
        self._dp_group = ps.get_data_parallel_group()
        self._pp_group = ps.get_pipeline_model_parallel_group()
        self._pp_last_global = ps.get_pipeline_model_parallel_last_rank()
        self.router_taps = None
        if self.arch.num_experts:
            from .moe import RouterTaps, install_replay

            self.router_taps = RouterTaps(self.model, self.arch.num_experts, self.arch.moe_top_k, self._dp_group)
            if self.algo.router_replay:
                if cfg.recompute != "none":
                    raise ValueError("algorithm.router_replay with trainer.recompute is not supported (the recomputed "
                                     "forward of a micro-batch may run after another micro-batch set the routes)")
                for m in (self.model, self.ref_model):
                    if m is not None:
                        install_replay(m)
        elif self.algo.router_replay:
            raise ValueError(f"algorithm.router_replay needs a mixture-of-experts model; {self.hf_dir} is a dense {self.arch.family}")
        self.critic = None
        if self.algo.advantage == "gae":
            from .critic import Critic

            self.critic = Critic(self, self.critic_cfg)

    @property
    def lora(self) -> bool:
        """Whether the policy trains low-rank adapters over a frozen base (``trainer.lora.rank`` > 0)."""
        return self.cfg.lora.rank > 0

    @property
    def serves_adapters(self) -> bool:
        """Whether engines get the adapters (not merged weights) at a weight sync."""
        return self.lora and not self.cfg.lora.merge_for_rollout

    def _load_model(self, *, adapters: bool = False):
        from megatron.core import parallel_state as ps

        with self._megatron_call():  # with pipeline stages, tied embeddings are synced via .cuda()
            model = build_gpt_model(
                self.arch, self.tconfig, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage()
            )
        if self.device == "cuda":
            model.cuda(torch.cuda.current_device())
        load_hf_weights(model, self.hf_dir, self.arch)
        if adapters:
            from .lora import apply_lora

            self.lora_params = apply_lora(model, self.arch, self.cfg.lora, seed=self.cfg.seed)
        return model

    def _megatron_call(self):
        return megatron_call(self.device)

    # ---- batches ----------------------------------------------------------------------------

    def _micro_batches(self, samples: Sequence[Sample], indices: Sequence[int]) -> list[MicroBatch]:
        plan = plan_micro_batches(samples, indices, self.cfg.micro_batch_tokens, self.cfg.batching)
        mbs = [build_micro_batch(samples, idx, self.cfg.batching) for idx in plan]
        if self.algo.router_replay:
            from .moe import micro_batch_routes

            for mb in mbs:
                if any(samples[i].routed_experts is not None and len(samples[i].routed_experts) for i in mb.samples):
                    mb.routes = micro_batch_routes(
                        [samples[i].routed_experts for i in mb.samples], [samples[i].seq_len for i in mb.samples],
                        self.arch.num_layers, self.arch.moe_top_k, mb.packed, mb.tokens.shape[-1],
                        [samples[i].key for i in mb.samples])
        return mbs

    def _run(self, model, mbs: list[MicroBatch], loss_fn, forward_only: bool) -> list[dict[str, torch.Tensor]]:
        replay = self.algo.router_replay

        def forward_step(data_iterator, m):
            mb = next(data_iterator)
            if replay:
                from .moe import ReplayRoutes, routers

                for layer, router in routers(m):
                    if isinstance(router.router_replay, ReplayRoutes):
                        router.router_replay.target = None if mb.routes is None else mb.routes[:, layer]
            with scoring_rows(m, mb.scored):  # logits of the loss tokens only: (1, K, V)
                out = m(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params())
            return out, partial(loss_fn, mb)

        moved = [mb.to(self.device) for mb in mbs] if self.device != "cpu" else mbs
        return self._fwd_bwd(
            forward_step_func=forward_step, data_iterator=iter(moved), model=[model],
            num_microbatches=len(moved), seq_length=max(mb.tokens.shape[1] for mb in moved),
            micro_batch_size=max(mb.tokens.shape[0] for mb in moved), forward_only=forward_only,
        )

    def _forward_only(self, model, mbs: list[MicroBatch], read, key: str) -> list[torch.Tensor] | None:
        """``read(mb, output) -> (zero loss, {key: tensor})`` for each micro-batch, no gradient;
        the tensors, on the host, on the last pipeline stage, None elsewhere."""
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                out = self._run(model, mbs, read, forward_only=True)
        finally:
            model.train(was_training)
        return _to_host([d[key] for d in out]) if self.layout.is_last_stage else None

    def _logprobs_per_mb(self, model, mbs: list[MicroBatch]) -> list[torch.Tensor] | None:
        """Per-position log-probs for each micro-batch (last pipeline stage; None elsewhere)."""

        def loss_fn(mb, logits):
            logp, _ = vocab_parallel_logprobs(logits, mb.at_scored(mb.targets), temperature=self.temperature)
            return logp.sum() * 0.0, {"logp": mb.spread(logp.detach()) * mb.loss_mask}  # to the host once, after the loop (_forward_only)

        return self._forward_only(model, mbs, loss_fn, "logp")

    def _per_sample(self, model, samples: Sequence[Sample], indices: Sequence[int]) -> dict[int, np.ndarray]:
        """Response-aligned log-probs of ``indices`` under ``model`` (last stage; {} elsewhere)."""
        if not indices:
            return {}
        mbs = self._micro_batches(samples, indices)
        out: dict[int, np.ndarray] = {}
        for mb, lp in zip(mbs, self._logprobs_per_mb(model, mbs) or []):
            out.update(per_response(mb, samples, lp))
        return out

    def _reference(self, samples: Sequence[Sample], indices: Sequence[int]) -> dict[int, np.ndarray]:
        with self._base_only():
            return self._per_sample(self.model if self.lora else self.ref_model, samples, indices)

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch, *, reference: bool = False) -> list[np.ndarray]:
        """Log-probs of every sample's response tokens under the current (or reference) policy,
        0 where the loss mask is 0. Every rank computes the whole batch and gets the result."""
        samples = to_samples(batch, self.arch.vocab_size)
        if reference and self.ref_model is None and not self.lora:
            raise ValueError("no reference model: algorithm.kl_coef is 0")
        model = self.ref_model if reference and not self.lora else self.model
        mbs = self._micro_batches(samples, range(len(samples)))
        with self._base_only() if reference else contextlib.nullcontext():
            logps = self._logprobs_per_mb(model, mbs)
        result: dict[int, np.ndarray] = {}
        if logps is not None:
            for mb, lp in zip(mbs, logps):
                result.update(per_response(mb, samples, lp))
        result = self._from_last_stage(result)
        return [result[i] for i in range(len(samples))]

    def _base_only(self):
        """The policy computing as the frozen base (its adapters skipped), for the reference."""
        from .lora import disabled

        return disabled(self.model) if self.lora else contextlib.nullcontext()

    def _from_last_stage(self, obj: Any) -> Any:
        if self.layout.pp == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self._pp_last_global, group=self._pp_group)
        return box[0]

    # ---- training ---------------------------------------------------------------------------

    def step(self, batch: Batch, *, shard: ShardTotals | None = None) -> dict[str, float]:
        """Train on ``batch``: ``ppo_epochs`` passes of ``ppo_mini_batch_size``-group mini-batches,
        one optimizer step each (``psrl.trainer.minibatch``); returns batch-level metrics (identical
        on every rank). The proximal policy's log-probs, the reference's and the critic's values are
        taken once, before the first mini-batch.

        With ``shard``, ``batch`` is this data-parallel rank's own share of the step (whole
        groups, fetched by the rank itself) and ``shard`` carries what needs the whole batch; the
        batch-statistics metrics then describe this share."""
        t0 = time.perf_counter()
        samples = to_samples(batch, self.arch.vocab_size)
        rewards = np.array([s.reward for s in samples])
        group_ids = [s.group_id for s in samples]
        if shard is not None:
            if not samples or len(shard.advantages) != len(samples):
                raise ValueError(f"a shard of {len(samples)} samples came with {len(shard.advantages)} advantages")
            adv = np.asarray(shard.advantages, np.float32)
            total_groups = int(self._dp_sum([len(groups_in_order(group_ids))])[0])
        else:
            if len(samples) < self.layout.dp:
                raise ValueError(f"a batch of {len(samples)} samples cannot be split over {self.layout.dp} data-parallel ranks")
            adv = (np.zeros(len(samples), np.float32) if self.critic is not None else
                   compute_advantages(rewards, group_ids, self.algo.advantage, self.algo.norm_adv_by_std))
            total_groups = None
        plan = plan_mini_batches(group_ids, mini_batch_size=self.cfg.ppo_mini_batch_size, epochs=self.cfg.ppo_epochs,
                                 seed=[self.cfg.seed, self.version], total_groups=total_groups)
        if shard is None:
            plan = [shard_for_rank(samples, self.layout.dp, self.layout.dp_rank, idx) for idx in plan]
        local = sorted({i for idx in plan for i in idx})

        # Once per batch, before any update: per-sample arrays on the last pipeline stage.
        prox = self._per_sample(self.model, samples, local) if self.algo.loss == "decoupled_ppo" else {}
        ref = self._reference(samples, local) if self.algo.kl_coef > 0 else {}
        last: dict[str, float] = {}  # metrics known on the last stage only
        if self.critic is not None:
            adv_tok, old_values, returns, last = self.critic.advantages(samples, local)
        else:
            adv_tok = {i: np.full(len(samples[i].response_ids), adv[i], np.float32) for i in local}
            old_values = returns = {}

        metrics: dict[str, float] = {}
        if self.router_taps is not None:
            self.router_taps.reset()
        clip_after_first: list[float] = []
        schedule = (self.scheduler.num_steps, self.critic.scheduler.num_steps if self.critic else 0.0)
        for n, idx in enumerate(plan):
            mbs = self._mini_batch(samples, idx, local, adv_tok, {"prox_logp": prox, "ref_logp": ref,
                                                                  "old_values": old_values, "returns": returns})
            m = self._optimizer_step(mbs, schedule[0], n + 1, len(plan))
            if self.critic is not None:
                cm = self.critic.train_step(mbs, schedule[1], n + 1, len(plan))
                m.update({f"critic/{k}": v for k, v in cm.items()})
            if n:
                clip_after_first.append(m.get("clip_frac", 0.0))
            for k, v in m.items():  # means over the optimizer steps; micro-batches counted
                if k in FIRST_STEP_METRICS:
                    if n == 0:
                        metrics[k] = v
                else:
                    metrics[k] = metrics.get(k, 0.0) + (v if k == "micro_batches" else v / len(plan))
        metrics["update_ok"] = float(metrics.get("update_ok", 0.0) > 1.0 - 1e-9)
        last["actor/clip_frac_after_first"] = float(np.mean(clip_after_first)) if clip_after_first else 0.0
        if self.router_taps is not None:
            last.update(self.router_taps.metrics())  # the layers of the last pipeline stage
        last.update({k: v for k, v in metrics.items()})
        metrics = self._from_last_stage(last)
        self.version += 1
        self.step_count += 1
        self.optimizer_steps += len(plan)

        elapsed = time.perf_counter() - t0
        metrics.update(step_metrics(samples, rewards, adv if self.critic is None else None, self.version, elapsed))
        metrics.update(lr=float(self.optimizer.param_groups[0]["lr"]), optimizer_steps=float(len(plan)))
        return metrics

    def _dp_sum(self, values: Sequence[float]) -> np.ndarray:
        vec = torch.tensor(list(values), dtype=torch.float64)
        if self.layout.dp > 1:
            vec = vec.to(self.device)  # NCCL (CUDA) reduces device tensors only
            dist.all_reduce(vec, group=self._dp_group)
        return vec.cpu().numpy()

    def _mini_batch(self, samples, idx, local, adv_tok, optional) -> list[MicroBatch]:
        """Micro-batches of one mini-batch with their per-position extras. A rank without a sample
        in it still steps (the collectives need every rank): on a zero-weight micro-batch."""
        mbs = self._micro_batches(samples, idx or [local[0] if local else 0])
        chosen = [samples[i] for i in idx]
        total_tokens, total_seqs = self._dp_sum([sum(s.num_loss_tokens for s in chosen), sum(1 for s in chosen if s.num_loss_tokens)])
        attach_policy_inputs(mbs, samples, adv_tok, optional, self.algo.loss_agg, int(total_tokens), int(total_seqs), dummy=not idx)
        return mbs

    def _optimizer_step(self, mbs: list[MicroBatch], schedule_start: float, done: int, total: int, *, loss_fn=None) -> dict[str, float]:
        self.optimizer.zero_grad()  # before the buffers: they make each fp32 param.grad a view of its buffer
        self.model.zero_grad_buffer()
        scale = len(mbs) * self.layout.dp  # undo the schedule's 1/num_microbatches and DDP's 1/dp
        out = self._run(self.model, mbs, partial(loss_fn or self._loss_fn, scale), forward_only=False)
        ok, grad_norm = optimizer_step(self.optimizer, self.model, clip_grad=self.cfg.optim.clip_grad,
                                       device=self.device, mp_group=self._mp_group, expert_group=self._expert_group)
        advance_schedule(self.scheduler, schedule_start, done, total)
        metrics = self._reduce_metrics(out, broadcast=False)
        metrics.update(grad_norm=grad_norm, update_ok=float(ok), micro_batches=float(len(mbs)))
        return metrics

    def sft_step(self, batch: Sequence[Sample]) -> dict[str, float]:
        """One supervised optimizer step (``psrl.trainer.sft_step``): cross-entropy on the loss-mask
        tokens; metrics ``loss``, ``token_acc``, ``tokens_per_s``."""
        from .sft_step import sft_step

        return sft_step(self, batch)

    def _loss_fn(self, scale: int, mb: MicroBatch, logits: torch.Tensor):
        return policy_loss_fn(self.algo, self.temperature, scale, mb, logits)

    def _reduce_metrics(self, out: list[dict[str, torch.Tensor]], broadcast: bool = True) -> dict[str, float]:
        """Sums over the micro-batches (and data-parallel ranks) of the loss functions' metric
        tensors, read back to the host once."""
        sums: dict[str, float] = {}
        if self.layout.is_last_stage:
            keys = sorted(out[0]) if out else []
            parts, order = [], []
            for names, op in (([k for k in keys if k not in MAX_METRICS], dist.ReduceOp.SUM),
                              ([k for k in keys if k in MAX_METRICS], dist.ReduceOp.MAX)):
                if not names:
                    continue
                # One (keys,) row per micro-batch, reduced in float64 on the device, where the
                # data-parallel group's backend reduces (NCCL on CUDA).
                rows = torch.stack([torch.stack([d[k] for k in names]).reshape(len(names)) for d in out]).double()
                vec = rows.sum(0) if op == dist.ReduceOp.SUM else rows.amax(0)
                if self.layout.dp > 1:
                    dist.all_reduce(vec, op=op, group=self._dp_group)
                parts.append(vec)
                order += names
            if parts:
                sums = dict(zip(order, torch.cat(parts).cpu().tolist()))  # one read back to the host
        return self._from_last_stage(sums) if broadcast else sums

    # ---- weights ----------------------------------------------------------------------------

    @property
    def is_weight_source(self) -> bool:
        """Ranks that send weights to engines: tensor rank 0 of data rank 0, one per pipeline stage."""
        return self.layout.tp_rank == 0 and self.layout.dp_rank == 0

    def hf_weights(self, dtype: torch.dtype | None = None, into: Mapping[str, torch.Tensor] | None = None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        """What a weight sync sends of this stage's layers: the adapters under PEFT's names when
        engines serve them (``serves_adapters``), else the HF-named weights (adapters merged in);
        every tensor-parallel rank must iterate. ``into``: buffers to export into by name."""
        if self.serves_adapters:
            from .lora import iter_peft_weights

            return iter_peft_weights(self.model, dtype, into)
        return iter_hf_weights(self.model, self.arch, dtype, into)

    def adapter_config(self) -> dict | None:
        """The served adapters' ``adapter_config.json`` (PEFT's fields); None without them."""
        if not self.serves_adapters:
            return None
        from .lora import peft_config

        return peft_config(self.cfg.lora, self.arch, str(self.hf_dir))

    def hf_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        return hf_state_dict(self.model, self.arch, dtype)

    def sync_dtype(self) -> torch.dtype:
        """The dtype engines load: the HF checkpoint's own."""
        return getattr(torch, self.arch.torch_dtype, torch.float32)

    def save_checkpoint(self, directory: str | None = None):
        """Collective: every rank calls it. Returns the step directory."""
        from .checkpoint import save_checkpoint

        return save_checkpoint(self, directory or self.cfg.checkpoint_dir)

    def load_checkpoint(self, path: str | None = None) -> None:
        """A step directory, or a checkpoint root (its latest step)."""
        from .checkpoint import load_checkpoint

        load_checkpoint(self, path or self.cfg.checkpoint_dir)

    def close(self) -> None:
        self._exit.close()

    def __enter__(self) -> MegatronTrainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` (one dtype) on the host in one device-to-host copy: each copy waits for the GPU."""
    if not tensors or tensors[0].device.type == "cpu":
        return tensors
    flat = torch.cat([t.reshape(-1) for t in tensors]).cpu()
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)]
