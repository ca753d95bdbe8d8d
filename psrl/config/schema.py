"""The root of the config tree."""

from __future__ import annotations

from typing import Literal

from .base import Section
from .data import DataConfig
from .logging import LoggingConfig
from .rollout import ActorRolloutRefConfig
from .sandbox import SandboxConfig
from .trainer import AlgorithmConfig, TrainerConfig
from .transfer_queue import TransferQueueConfig


class RayConfig(Section):
    address: str = "local"  # "local" starts a private cluster; "auto" or "host:port" joins one


class PSRLConfig(Section):
    data: DataConfig = DataConfig()
    # Training rollouts.
    gen_actor_rollout_ref: ActorRolloutRefConfig = ActorRolloutRefConfig()
    # Validation rollouts.
    train_actor_rollout_ref: ActorRolloutRefConfig = ActorRolloutRefConfig()
    trainer: TrainerConfig = TrainerConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    transfer_queue: TransferQueueConfig = TransferQueueConfig()
    sandbox: SandboxConfig = SandboxConfig()
    logging: LoggingConfig = LoggingConfig()
    launcher: Literal["local", "ray"] = "local"
    ray: RayConfig = RayConfig()
