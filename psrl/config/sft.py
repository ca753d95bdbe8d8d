"""``psrl sft``: supervised fine-tuning on the Megatron trainer (``trainer.*`` gives its device,
parallel layout, batching and micro-batch budget; this section the data and the schedule)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Section


class SFTConfig(Section):
    # Parquet/jsonl files: rows with a ``messages`` column (OpenAI-style chat, tool calls and tool
    # messages included; optional ``tools``) or trajectories written by ``psrl rollout``.
    data: list[str] = []
    # "auto" tells the two apart by their columns.
    format: Literal["auto", "messages", "trajectories"] = "auto"
    # Trajectories with a lower reward are skipped (None: all of them).
    min_reward: float | None = None
    # The model to fine-tune; None = trainer.model_path, else gen_actor_rollout_ref.model.path.
    model_path: str | None = None
    # How rendered messages write an assistant's tool calls (the model's own text in RL).
    tool_parser: Literal["hermes"] = "hermes"
    system_prompt: str | None = None
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)  # stop earlier than the epochs say
    # Step size: ``batch_size`` sequences, or, when set, up to ``batch_tokens`` tokens.
    batch_size: int = Field(8, ge=1)
    batch_tokens: int | None = Field(None, ge=16)
    max_length: int = Field(2048, ge=16)  # longer sequences are cut at the end (loss tokens dropped)
    lr: float = Field(1e-5, gt=0)
    min_lr: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "cosine"
    shuffle: bool = True
    seed: int = 0
    save_dir: str = "runs/sft"  # trainer checkpoints (step_*/, latest), config.yaml, hf/
    save_every: int = Field(0, ge=0)  # steps; the final step is always saved
    export_hf: bool = True  # write the final weights as a Hugging Face directory to save_dir/hf

    @model_validator(mode="after")
    def _lr_floor(self) -> SFTConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"sft.min_lr ({self.min_lr}) is above sft.lr ({self.lr})")
        return self
