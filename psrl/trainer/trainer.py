"""The Megatron-Core trainer: one policy (and an optional frozen reference), one ``step`` per batch.

Every rank receives the whole batch and computes advantages and loss normalizers from it (they are
global quantities); it then trains on its data-parallel share, split into micro-batches that
Megatron's forward-backward schedule runs (pipelined when pipeline parallel > 1).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist

from psrl.config import AlgorithmConfig, TrainerConfig
from psrl.models import resolve_model_path
from psrl.trajectory import NO_VERSION, Trajectory

from . import cpu_compat
from .advantages import compute_advantages
from .batch import MicroBatch, Sample, build_micro_batch, per_position, per_response, plan_micro_batches, shard_for_rank, to_samples
from .distributed import init_parallel, resolve_device, shutdown_parallel
from .losses import aggregation_weights, behaviour_weights, policy_loss, sft_loss
from .logprobs import vocab_parallel_argmax_hits, vocab_parallel_logprobs
from .model import HFArch, build_gpt_model, transformer_config
from .weights import hf_state_dict, iter_hf_weights, load_hf_weights

Batch = pa.RecordBatch | pa.Table | Sequence[Trajectory]


@dataclass(frozen=True)
class ShardTotals:
    """What a data-parallel rank stepping on its own share needs from the whole step's batch."""

    advantages: Sequence[float]  # of the share's samples, in their order
    total_tokens: int  # loss tokens of the whole step (loss aggregation)
    total_seqs: int  # samples with at least one loss token


class MegatronTrainer:
    """``step(batch) -> metrics``; ``compute_logprobs(batch)``; HF-named weights for engines.

    ``temperature`` is the rollout sampling temperature: log-probs are taken from logits / T so
    they match what the engine sampled from.
    """

    def __init__(
        self,
        model_path: str | None = None,
        config: TrainerConfig | None = None,
        algorithm: AlgorithmConfig | None = None,
        *,
        temperature: float = 1.0,
    ) -> None:
        self.cfg = config or TrainerConfig()
        self.algo = algorithm or AlgorithmConfig()
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
        self.version = 0  # policy version: optimizer steps taken (plus the resumed count)
        self.step_count = 0
        self._exit = contextlib.ExitStack()
        try:
            self._setup()
        except BaseException:
            self._exit.close()
            raise

    # ---- construction -----------------------------------------------------------------------

    def _setup(self) -> None:
        with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": expected here
            warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
            from megatron.core import parallel_state as ps
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
            from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
            from megatron.core.pipeline_parallel import get_forward_backward_func

        cfg, p = self.cfg, self.cfg.parallel
        on_cpu = self.device == "cpu"
        if on_cpu:
            self._exit.enter_context(cpu_compat.megatron_on_cpu())
        torch.manual_seed(cfg.seed)
        self.layout = init_parallel(p.tensor, p.pipeline, p.data, self.device, cfg.seed)
        self._exit.callback(shutdown_parallel, self.layout)
        self.tconfig = transformer_config(
            self.arch, tp=p.tensor, pp=p.pipeline, dtype=cfg.dtype, device=self.device, recompute=cfg.recompute
        )
        self.model = DistributedDataParallel(
            config=self.tconfig,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False),
            module=self._load_model(),
        )
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        o = cfg.optim
        with self._megatron_call():  # the optimizer wrapper allocates its loss scale with device="cuda"
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                    adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_eps=o.eps,
                    # Megatron's clipping asserts CUDA tensors; on CPU cpu_compat clips instead.
                    clip_grad=0.0 if on_cpu else o.clip_grad,
                    bf16=cfg.dtype == "bfloat16", params_dtype=self.tconfig.params_dtype,
                    use_distributed_optimizer=False,
                ),
                [self.model],
                use_gloo_process_groups=not on_cpu,
            )
        decay_steps = max(cfg.total_steps, o.warmup_steps + 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if o.warmup_steps else o.lr, max_lr=o.lr, min_lr=o.min_lr,
            lr_warmup_steps=o.warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=o.lr_schedule,
            start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant",
        )
        self.ref_model = None
        if self.algo.kl_coef > 0:
            self.ref_model = self._load_model()
            self.ref_model.requires_grad_(False)
            self.ref_model.eval()
        self._fwd_bwd = get_forward_backward_func()
        self._mp_group = ps.get_model_parallel_group()
        self._dp_group = ps.get_data_parallel_group()
        self._pp_group = ps.get_pipeline_model_parallel_group()
        self._pp_last_global = ps.get_pipeline_model_parallel_last_rank()

    def _load_model(self):
        from megatron.core import parallel_state as ps

        with self._megatron_call():  # with pipeline stages, tied embeddings are synced via .cuda()
            model = build_gpt_model(
                self.arch, self.tconfig, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage()
            )
        if self.device == "cuda":
            model.cuda(torch.cuda.current_device())
        load_hf_weights(model, self.hf_dir, self.arch)
        return model

    def _megatron_call(self):
        return cpu_compat.cuda_allocations_on_cpu() if self.device == "cpu" else contextlib.nullcontext()

    # ---- batches ----------------------------------------------------------------------------

    def _micro_batches(self, samples: Sequence[Sample], indices: Sequence[int]) -> list[MicroBatch]:
        plan = plan_micro_batches(samples, indices, self.cfg.micro_batch_tokens, self.cfg.batching)
        return [build_micro_batch(samples, idx, self.cfg.batching) for idx in plan]

    def _run(self, model, mbs: list[MicroBatch], loss_fn, forward_only: bool) -> list[dict[str, torch.Tensor]]:
        def forward_step(data_iterator, m):
            mb = next(data_iterator)
            out = m(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params())
            return out, partial(loss_fn, mb)

        moved = [mb.to(self.device) for mb in mbs] if self.device != "cpu" else mbs
        with self._megatron_call():
            return self._fwd_bwd(
                forward_step_func=forward_step, data_iterator=iter(moved), model=[model],
                num_microbatches=len(moved), seq_length=max(mb.tokens.shape[1] for mb in moved),
                micro_batch_size=max(mb.tokens.shape[0] for mb in moved), forward_only=forward_only,
            )

    def _logprobs_per_mb(self, model, mbs: list[MicroBatch]) -> list[torch.Tensor] | None:
        """Per-position log-probs for each micro-batch (last pipeline stage; None elsewhere)."""

        def loss_fn(mb, logits):
            logp, _ = vocab_parallel_logprobs(logits, mb.targets.to(logits.device), temperature=self.temperature)
            return logp.sum() * 0.0, {"logp": (logp * mb.loss_mask.to(logp.device)).detach().cpu()}

        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                out = self._run(model, mbs, loss_fn, forward_only=True)
        finally:
            model.train(was_training)
        return [d["logp"] for d in out] if self.layout.is_last_stage else None

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch, *, reference: bool = False) -> list[np.ndarray]:
        """Log-probs of every sample's response tokens under the current (or reference) policy,
        0 where the loss mask is 0. Every rank computes the whole batch and gets the result."""
        samples = to_samples(batch, self.arch.vocab_size)
        model = self.ref_model if reference else self.model
        if model is None:
            raise ValueError("no reference model: algorithm.kl_coef is 0")
        mbs = self._micro_batches(samples, range(len(samples)))
        logps = self._logprobs_per_mb(model, mbs)
        result: dict[int, np.ndarray] = {}
        if logps is not None:
            for mb, lp in zip(mbs, logps):
                result.update(per_response(mb, samples, lp))
        result = self._from_last_stage(result)
        return [result[i] for i in range(len(samples))]

    def _from_last_stage(self, obj: Any) -> Any:
        if self.layout.pp == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self._pp_last_global, group=self._pp_group)
        return box[0]

    # ---- training ---------------------------------------------------------------------------

    def step(self, batch: Batch, *, shard: ShardTotals | None = None) -> dict[str, float]:
        """One optimizer step on ``batch``; returns batch-level metrics (identical on every rank).

        With ``shard``, ``batch`` is this data-parallel rank's own share of the step (whole
        groups, fetched by the rank itself) and ``shard`` carries what needs the whole batch; the
        batch-statistics metrics then describe this share."""
        t0 = time.perf_counter()
        samples = to_samples(batch, self.arch.vocab_size)
        rewards = np.array([s.reward for s in samples])
        if shard is not None:
            if not samples or len(shard.advantages) != len(samples):
                raise ValueError(f"a shard of {len(samples)} samples came with {len(shard.advantages)} advantages")
            adv = np.asarray(shard.advantages, np.float32)
            total_tokens, total_seqs = shard.total_tokens, shard.total_seqs
            local = list(range(len(samples)))
        else:
            if len(samples) < self.layout.dp:
                raise ValueError(f"a batch of {len(samples)} samples cannot be split over {self.layout.dp} data-parallel ranks")
            adv = compute_advantages(rewards, [s.group_id for s in samples], self.algo.advantage, self.algo.norm_adv_by_std)
            total_tokens = sum(s.num_loss_tokens for s in samples)
            total_seqs = sum(1 for s in samples if s.num_loss_tokens)
            local = shard_for_rank(samples, self.layout.dp, self.layout.dp_rank)
        mbs = self._micro_batches(samples, local)
        seq_tokens = torch.tensor([s.num_loss_tokens for s in samples], dtype=torch.float32)
        for mb in mbs:
            mb.extras["adv"] = per_position(mb, samples, [np.full(len(s.response_ids), adv[i]) for i, s in enumerate(samples)])
            mb.extras["behav_logp"] = per_position(mb, samples, [s.logprobs for s in samples])
            pos_seq_tokens = seq_tokens[mb.sample_index.clamp(min=0)]
            mb.extras["weight"] = aggregation_weights(mb.loss_mask, pos_seq_tokens, self.algo.loss_agg, total_tokens, total_seqs)
        if self.algo.loss == "decoupled_ppo":
            for mb, lp in zip(mbs, self._logprobs_per_mb(self.model, mbs) or []):
                mb.extras["prox_logp"] = lp
        if self.ref_model is not None:
            for mb, lp in zip(mbs, self._logprobs_per_mb(self.ref_model, mbs) or []):
                mb.extras["ref_logp"] = lp

        out, grad_norm, ok = self._optimize(mbs, self._loss_fn)
        metrics = self._reduce_metrics(out)
        trained = [s for s in samples if s.num_loss_tokens]
        stale = np.concatenate([self.version - 1 - s.versions[(s.loss_mask == 1) & (s.versions != NO_VERSION)] for s in trained] or [np.zeros(0)])
        elapsed = time.perf_counter() - t0
        tokens = sum(s.seq_len for s in samples)
        metrics.update(
            grad_norm=grad_norm,
            update_ok=float(bool(ok)),
            lr=float(self.optimizer.param_groups[0]["lr"]),
            reward_mean=float(rewards.mean()),
            reward_std=float(rewards.std()),
            adv_mean=float(adv.mean()),
            adv_abs_mean=float(np.abs(adv).mean()),
            response_len_mean=float(np.mean([len(s.response_ids) for s in samples])),
            samples=float(len(samples)),
            micro_batches=float(len(mbs)),
            loss_tokens=float(sum(s.num_loss_tokens for s in samples)),  # this share's (the whole batch unsharded)
            tokens=float(tokens),
            staleness_mean=float(stale.mean()) if len(stale) else 0.0,
            staleness_max=float(stale.max()) if len(stale) else 0.0,
            step_s=elapsed,
            tokens_per_s=tokens / elapsed,
            version=float(self.version),
        )
        return metrics

    def _optimize(self, mbs: list[MicroBatch], loss_fn) -> tuple[list[dict[str, torch.Tensor]], float, bool]:
        """Forward-backward over ``mbs`` with ``loss_fn(scale, mb, logits)``, then one optimizer
        step; returns the micro-batches' metrics, the gradient norm and whether the update ran."""
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        scale = len(mbs) * self.layout.dp  # undo the schedule's 1/num_microbatches and DDP's 1/dp
        out = self._run(self.model, mbs, partial(loss_fn, scale), forward_only=False)
        if self.device == "cpu":
            grad_norm = cpu_compat.clip_grad_norm(self.model.parameters(), self.cfg.optim.clip_grad, self._mp_group)
        with self._megatron_call():
            ok, gn, _ = self.optimizer.step()
        if self.device != "cpu":
            grad_norm = float(gn) if gn is not None else float("nan")
        self.scheduler.step(1)
        self.version += 1
        self.step_count += 1
        return out, grad_norm, bool(ok)

    def sft_step(self, batch: Sequence[Sample]) -> dict[str, float]:
        """One supervised optimizer step: cross-entropy on the loss-mask tokens, averaged over all
        of the batch's loss tokens (every rank passes the whole batch and trains its share).
        Metrics: ``loss``, ``token_acc`` (greedy prediction = target, on loss tokens), ``tokens_per_s``."""
        t0 = time.perf_counter()
        samples = to_samples(batch, self.arch.vocab_size)
        if len(samples) < self.layout.dp:
            raise ValueError(f"a batch of {len(samples)} samples cannot be split over {self.layout.dp} data-parallel ranks")
        total_tokens = sum(s.num_loss_tokens for s in samples)
        if total_tokens == 0:
            raise ValueError("an SFT batch without loss tokens")
        mbs = self._micro_batches(samples, shard_for_rank(samples, self.layout.dp, self.layout.dp_rank))
        for mb in mbs:
            mb.extras["weight"] = mb.loss_mask / total_tokens
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate this step uses
        out, grad_norm, ok = self._optimize(mbs, self._sft_loss_fn)
        metrics = self._reduce_metrics(out)
        elapsed = time.perf_counter() - t0
        tokens = sum(s.seq_len for s in samples)
        metrics.update(
            grad_norm=grad_norm, update_ok=float(ok), lr=lr,
            samples=float(len(samples)), micro_batches=float(len(mbs)), loss_tokens=float(total_tokens),
            tokens=float(tokens), step_s=elapsed, tokens_per_s=tokens / elapsed, version=float(self.version),
        )
        return metrics

    def _sft_loss_fn(self, scale: int, mb: MicroBatch, logits: torch.Tensor):
        dev = logits.device
        targets = mb.targets.to(dev)
        logp, _ = vocab_parallel_logprobs(logits, targets)
        terms = sft_loss(logp, vocab_parallel_argmax_hits(logits.detach(), targets), mb.extras["weight"].to(dev))
        return terms.loss * scale, {k: v.detach().float().cpu() for k, v in terms.metrics.items()}

    def _loss_fn(self, scale: int, mb: MicroBatch, logits: torch.Tensor):
        dev = logits.device
        x = {k: v.to(dev) for k, v in mb.extras.items()}
        logp, entropy = vocab_parallel_logprobs(
            logits, mb.targets.to(dev), temperature=self.temperature, with_entropy=True,
            entropy_grad=self.algo.entropy_coef != 0,
        )
        behav_weight = None
        if self.algo.loss == "decoupled_ppo":
            old = x["prox_logp"]
            behav_weight = behaviour_weights(old, x["behav_logp"], self.algo.tis_cap, self.algo.tis_mode)
        else:
            old = x["behav_logp"]
        terms = policy_loss(
            logp, old, x["adv"], x["weight"], self.algo,
            behav_weight=behav_weight, ref_logp=x.get("ref_logp"), entropy=entropy,
        )
        # The schedule divides the returned tensor in place: hand it a fresh one.
        return terms.loss * scale, {k: v.detach().float().cpu() for k, v in terms.metrics.items()}

    def _reduce_metrics(self, out: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        sums: dict[str, float] = {}
        if self.layout.is_last_stage:
            keys = sorted(out[0]) if out else []
            vec = torch.tensor([sum(float(d[k]) for d in out) for k in keys], dtype=torch.float64)
            if self.layout.dp > 1:
                dist.all_reduce(vec, group=self._dp_group)
            sums = dict(zip(keys, vec.tolist()))
        return self._from_last_stage(sums)

    # ---- weights ----------------------------------------------------------------------------

    @property
    def is_weight_source(self) -> bool:
        """Ranks that send weights to engines: tensor rank 0 of data rank 0, one per pipeline stage."""
        return self.layout.tp_rank == 0 and self.layout.dp_rank == 0

    def hf_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named tensors of this stage's layers; every tensor-parallel rank must iterate."""
        return iter_hf_weights(self.model, self.arch, dtype)

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
