"""``psrl sft CONFIG``: supervised fine-tuning on ``MegatronTrainer`` (the trainer ``psrl train``
uses: same packing, parallel layout and checkpoint format).

Writes under ``sft.save_dir``: ``step_*/`` + ``latest`` (trainer checkpoints, what ``psrl export``
reads), ``config.yaml`` (the resolved config, the model as an absolute directory),
``metrics.jsonl`` (one line a step) and, with ``sft.export_hf``, ``hf/``: the final weights as a
Hugging Face directory, which ``psrl train`` and the engines start from
(``gen_actor_rollout_ref.model.path=<save_dir>/hf``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from psrl.config import AlgorithmConfig, ConfigError, PSRLConfig
from psrl.log import get_logger

from .data import SFTDataError, load_samples, plan_batches

log = get_logger(__name__)


@dataclass(frozen=True)
class SFTSummary:
    steps: int
    samples: int
    first_loss: float
    last_loss: float
    first_token_acc: float
    last_token_acc: float
    tokens_per_s: float
    wall_s: float
    checkpoint: str
    hf_dir: str | None


def trainer_config(cfg: PSRLConfig, steps: int) -> Any:
    """``cfg.trainer`` with the SFT schedule: its lr, decay over ``steps``, checkpoints in save_dir."""
    s = cfg.sft
    optim = cfg.trainer.optim.model_copy(update={"lr": s.lr, "min_lr": s.min_lr, "warmup_steps": s.warmup_steps, "lr_schedule": s.lr_schedule})
    return cfg.trainer.model_copy(update={"total_steps": max(steps, 1), "checkpoint_dir": s.save_dir, "optim": optim})


def run_sft(cfg: PSRLConfig, *, echo: bool = True) -> SFTSummary:
    from transformers import AutoTokenizer

    from psrl.models import resolve_model_path
    from psrl.pipeline.train import write_resolved_config
    from psrl.trainer.trainer import MegatronTrainer

    s = cfg.sft
    model = s.model_path or cfg.trainer.model_path or cfg.gen_actor_rollout_ref.model.path
    try:
        model_dir = resolve_model_path(model)
    except FileNotFoundError as e:
        raise ConfigError(f"sft.model_path: {e}") from None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    try:
        samples, counts = load_samples(s.data, tokenizer, fmt=s.format, max_length=s.max_length, min_reward=s.min_reward, system_prompt=s.system_prompt)
    except SFTDataError as e:
        raise ConfigError(f"sft.data: {e}") from None
    steps = plan_batches(samples, batch_size=s.batch_size, batch_tokens=s.batch_tokens, epochs=s.epochs, shuffle=s.shuffle, seed=s.seed)
    if s.max_steps is not None:
        steps = steps[: s.max_steps]
    log.info("sft data", examples=len(samples), steps=len(steps), **counts)
    save = Path(s.save_dir)
    resolved = cfg.model_copy(deep=True)
    resolved.trainer.checkpoint_dir = s.save_dir
    resolved.logging.output_dir = s.save_dir
    write_resolved_config(resolved, model_dir)
    metrics_file = (save / "metrics.jsonl").open("a")
    history: list[dict[str, float]] = []
    t0 = time.perf_counter()
    with MegatronTrainer(model_dir, trainer_config(cfg, len(steps)), AlgorithmConfig()) as trainer:
        for k, idx in enumerate(steps, 1):
            m = trainer.sft_step([samples[i] for i in idx])
            m["step"] = float(k)
            history.append(m)
            metrics_file.write(json.dumps(m) + "\n")
            metrics_file.flush()
            if echo:
                print(f"sft step {k}/{len(steps)}  loss {m['loss']:.4f}  token_acc {m['token_acc']:.4f}  "
                      f"tokens/s {m['tokens_per_s']:.1f}  lr {m['lr']:.2e}  ({int(m['samples'])} seqs, {int(m['loss_tokens'])} loss tokens)", flush=True)
            if s.save_every and k % s.save_every == 0 and k < len(steps):
                trainer.save_checkpoint(s.save_dir)
        ckpt = trainer.save_checkpoint(s.save_dir)
    metrics_file.close()
    hf_dir = None
    if s.export_hf:
        from psrl.trainer.export import export_checkpoint

        hf_dir = str(export_checkpoint(ckpt, save / "hf", model_dir))
    wall = time.perf_counter() - t0
    tokens = sum(m["tokens"] for m in history)
    summary = SFTSummary(
        steps=len(history), samples=len(samples),
        first_loss=history[0]["loss"], last_loss=history[-1]["loss"],
        first_token_acc=history[0]["token_acc"], last_token_acc=history[-1]["token_acc"],
        tokens_per_s=tokens / max(sum(m["step_s"] for m in history), 1e-9), wall_s=wall,
        checkpoint=str(ckpt), hf_dir=hf_dir,
    )
    log.info("sft done", **asdict(summary))
    if echo:
        print(json.dumps(asdict(summary)))
    return summary
