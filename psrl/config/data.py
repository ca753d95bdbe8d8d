from __future__ import annotations

from .base import Section


class DataConfig(Section):
    """Dataset files and batch shape. A row is one task; a batch holds ``batch_size`` tasks."""

    train_files: list[str] = []
    val_files: list[str] = []
    batch_size: int = 8
    val_batch_size: int = 8
    max_prompt_length: int = 512
    shuffle: bool = True
    seed: int = 0
    max_samples: int | None = None  # use at most this many rows of the files (None: all)
    # Keep the chat messages of each row beside the token ids (needed by chat-level agent loops).
    return_raw_chat: bool = True
