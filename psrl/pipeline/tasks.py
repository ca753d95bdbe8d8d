"""The data-loader position: which dataset row comes next, across epochs, checkpointable.

Rows come in a seeded permutation per epoch. Rows handed out but not trained on when a checkpoint
is taken (in flight or waiting in the queue) are saved in ``replay`` and come out first after a
resume, so a resumed run neither repeats nor skips a row.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


class TaskSource:
    def __init__(self, rows: Sequence[Mapping[str, Any]], *, shuffle: bool = True, seed: int = 0) -> None:
        if not rows:
            raise ValueError("the training dataset is empty: data.train_files gave no rows")
        self.rows = rows
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self.replay: deque[int] = deque()
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def next(self) -> tuple[int, Mapping[str, Any]]:
        """The next row index and row; epochs roll over forever."""
        if self.replay:
            index = self.replay.popleft()
            return index, self.rows[index]
        if self.cursor >= len(self._order):
            self.epoch += 1
            self.cursor = 0
            self._order = self._permutation(self.epoch)
        index = int(self._order[self.cursor])
        self.cursor += 1
        return index, self.rows[index]

    def push_front(self, indices: Sequence[int]) -> None:
        """Hand these rows out again, first, in this order."""
        self.replay.extendleft(reversed(list(indices)))

    def state_dict(self, not_trained: Sequence[int] = ()) -> dict[str, Any]:
        """``not_trained``: rows handed out whose samples the trainer has not consumed."""
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "replay": [*not_trained, *self.replay],
            "num_rows": len(self.rows),
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["num_rows"] != len(self.rows):
            raise ValueError(
                f"the checkpoint was taken with a dataset of {state['num_rows']} rows, this one has {len(self.rows)}:"
                " resume with the same data.train_files"
            )
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._permutation(self.epoch)
        self.replay = deque(int(i) for i in state["replay"])
