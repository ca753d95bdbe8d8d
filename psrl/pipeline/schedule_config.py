"""What a run's scheduler is set to: the mode and its ``eta`` (how many versions rollouts may run
ahead of the trainer; ``psrl.pipeline.scheduler`` says what each mode means), the batch shape,
the cadence of evals and saves, and what happens to failed and stale groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["sync", "one_step_off", "async"]


def eta_for(mode: Mode, max_staleness: int) -> int:
    return {"sync": 0, "one_step_off": 1}.get(mode, max_staleness)


@dataclass(frozen=True)
class ScheduleConfig:
    mode: Mode = "sync"
    eta: int = 0
    groups_per_step: int = 8  # B: dataset rows (GRPO groups) per trainer step
    group_size: int = 1  # n: episodes per row
    total_steps: int = 10
    eval_every: int = 0
    save_every: int = 0
    colocated: bool = True
    shared_hardware: bool = True  # engines and trainer on the same cores (every part on one machine)
    max_failure_rate: float = 0.5
    on_stale: Literal["drop", "refill"] = "drop"
    on_failure: Literal["keep_group", "drop_group"] = "drop_group"
    max_running_groups: int = 1 << 30  # a cap below admission (e.g. engine / sandbox capacity)
    val_group_size: int = 1
    val_concurrency: int = 64

    @property
    def samples_per_step(self) -> int:
        return self.groups_per_step * self.group_size
