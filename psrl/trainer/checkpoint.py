"""Trainer checkpoints: model, optimizer, LR scheduler, RNG states, step and policy version (and the
critic's model, optimizer and scheduler with ``algorithm.advantage=gae``).

Layout: ``<dir>/step_<N>/tp<T>_pp<P>.pt`` (written by data-parallel rank 0; the data-parallel
replicas are identical) plus ``<dir>/latest`` naming the newest complete step. A step directory
is written under a temporary name and renamed once every shard is on disk, so a crash mid-save
leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from .lora import load_trainable_state, peft_config, trainable_state
from .optim import use_fused_adam

if TYPE_CHECKING:
    from .trainer import MegatronTrainer

_FORMAT = 1


def _rng_state(device: str) -> dict:
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if device == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict, device: str) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if device == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(trainer: MegatronTrainer, directory: str | Path) -> Path:
    """Save on every rank (collective); returns the step directory."""
    if trainer.cfg.parallel.expert > 1:
        # Data-parallel rank 0 writes; with expert parallelism it holds only its share of the experts.
        raise ValueError("trainer checkpoints with trainer.parallel.expert > 1 are not supported yet "
                         "(train with expert 1 to save, or set trainer.save_every=0)")
    root = Path(directory)
    lay = trainer.layout
    final = root / f"step_{trainer.step_count:08d}"
    tmp = root / f".step_{trainer.step_count:08d}.tmp"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    if lay.dp_rank == 0:
        state = {
            "format": _FORMAT,
            "step": trainer.step_count,
            "version": trainer.version,
            "layout": {"tp": lay.tp, "pp": lay.pp},
            # With adapters only they are saved (the base is the model on disk, named under "lora").
            "model": trainable_state(trainer.model) if trainer.lora else trainer.model.module.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict(),
            "rng": _rng_state(trainer.device),
        }
        if trainer.ref_model is not None:
            state["ref_model"] = trainer.ref_model.state_dict()
        if trainer.critic is not None:
            state["critic"] = trainer.critic.state_dict()
        state["optimizer_steps"] = trainer.optimizer_steps
        if trainer.lora:
            state["lora"] = {"base": str(trainer.hf_dir), "config": trainer.cfg.lora.model_dump(),
                             "adapter_config": peft_config(trainer.cfg.lora, trainer.arch, str(trainer.hf_dir))}
        torch.save(state, tmp / f"tp{lay.tp_rank}_pp{lay.pp_rank}.pt")
    _barrier()
    if rank0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        (root / "latest.tmp").write_text(final.name + "\n")
        (root / "latest.tmp").rename(root / "latest")
    _barrier()
    return final


def latest_checkpoint(directory: str | Path) -> Path | None:
    root = Path(directory)
    marker = root / "latest"
    if not marker.is_file():
        return None
    path = root / marker.read_text().strip()
    return path if path.is_dir() else None


def load_checkpoint(trainer: MegatronTrainer, path: str | Path) -> None:
    """Restore a step directory (or the latest one under a checkpoint root) into ``trainer``."""
    path = Path(path)
    if (path / "latest").is_file():
        found = latest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"{path}: 'latest' names a missing step directory")
        path = found
    lay = trainer.layout
    shard = path / f"tp{lay.tp_rank}_pp{lay.pp_rank}.pt"
    if not shard.is_file():
        raise FileNotFoundError(f"{shard} is missing (checkpoint written with another parallel layout?)")
    state = torch.load(shard, map_location="cpu", weights_only=False)
    if state.get("format") != _FORMAT:
        raise ValueError(f"{shard}: checkpoint format {state.get('format')} is not {_FORMAT}")
    if state["layout"] != {"tp": lay.tp, "pp": lay.pp}:
        raise ValueError(f"{shard}: saved with {state['layout']}, this trainer runs tp={lay.tp} pp={lay.pp}")
    saved_lora = state.get("lora")
    if trainer.lora != (saved_lora is not None):
        raise ValueError(f"{shard}: saved {'with' if saved_lora else 'without'} trainer.lora adapters, this trainer runs "
                         f"{'with' if trainer.lora else 'without'} them (trainer.lora.rank={trainer.cfg.lora.rank})")
    if saved_lora is not None:
        if saved_lora["config"]["rank"] != trainer.cfg.lora.rank:
            raise ValueError(f"{shard}: adapters of rank {saved_lora['config']['rank']}, this trainer's "
                             f"trainer.lora.rank is {trainer.cfg.lora.rank}")
        load_trainable_state(trainer.model, state["model"], str(shard))
    else:
        trainer.model.module.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    use_fused_adam(trainer.optimizer)  # the saved groups replaced ours (a checkpoint of older code: unfused)
    trainer.scheduler.load_state_dict(state["scheduler"])
    if trainer.ref_model is not None and "ref_model" in state:
        trainer.ref_model.load_state_dict(state["ref_model"])
    if trainer.critic is not None:
        if "critic" not in state:
            raise ValueError(f"{shard}: no critic in this checkpoint (saved without algorithm.advantage=gae)")
        trainer.critic.load_state_dict(state["critic"])
    _set_rng_state(state["rng"], trainer.device)
    trainer.optimizer_steps = int(state.get("optimizer_steps", state["step"]))
    trainer.step_count = int(state["step"])
    trainer.version = int(state["version"])
