"""The root of the config tree."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import Section
from .data import DataConfig
from .gateway import GatewayConfig
from .logging import LoggingConfig
from .rollout import ActorRolloutRefConfig
from .sandbox import SandboxConfig
from .sft import SFTConfig
from .trainer import AlgorithmConfig, CriticConfig, TrainerConfig
from .transfer_queue import TransferQueueConfig
from .weight_sync import WeightSyncConfig


class ActorResources(Section):
    """What one Ray actor asks the cluster for (logical resources: Ray places, it does not limit)."""

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    memory_gb: float | None = Field(None, gt=0)  # reserved heap memory; None = no reservation
    resources: dict[str, float] = {}  # custom resources, e.g. {"trainer_node": 1} to pin a node kind


def _default_forward_env() -> list[str]:
    return [
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "VLLM_HOST_IP", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
        "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PSRL_LOG_LEVEL", "PSRL_CACHE_DIR",
    ]


class RayConfig(Section):
    """``launcher=ray``: engine replicas, trainer ranks, transfer-queue controller and storage units
    run as Ray actors; rollout workers (agent loops, environments, sandboxes) run in the driver or,
    with ``rollout_workers > 0``, as actors; the scheduler runs in the driver. Data moves over the
    transfer queue (ZeroMQ tcp), not through Ray."""

    address: str = "local"  # "local" starts a private cluster; "auto" or "host:port" joins one
    namespace: str | None = None
    # Only for address="local": the private cluster's size (None: what Ray detects).
    num_cpus: int | None = Field(None, ge=1)
    num_gpus: int | None = Field(None, ge=0)
    # Where queue services bind: None = transfer_queue.host (loopback by default: one node);
    # "node" = each service's node address as Ray reports it (multi-node; set curve_auth too).
    queue_host: str | None = None
    engine: ActorResources = ActorResources(num_cpus=1.0)  # per engine replica (GPUs: its tensor-parallel size)
    trainer: ActorResources = ActorResources(num_cpus=1.0)  # per trainer rank (tensor x pipeline x data ranks)
    queue: ActorResources = ActorResources(num_cpus=0.0)  # the controller and each storage unit
    # Rollout workers: 0 runs agent loops, environments and sandboxes in the driver; N > 0 runs
    # them in N actors (each its own sandbox pool and ``*.rollout.agent.max_concurrency``
    # episodes), placed by ``rollout_worker`` (custom resources put them on environment nodes).
    rollout_workers: int = Field(0, ge=0)
    rollout_worker: ActorResources = ActorResources(num_cpus=0.0)
    rollout_worker_max_restarts: int = Field(16, ge=0)  # replacements for dead workers before the run stops
    actor_start_timeout_s: float = Field(600.0, gt=0)  # waiting longer for resources is an error
    # Environment of every actor: ``env_vars``, plus the named variables copied from the driver.
    env_vars: dict[str, str] = {}
    forward_env: list[str] = Field(default_factory=_default_forward_env)

    @field_validator("queue", "rollout_worker", mode="before")
    @classmethod
    def _waiting_actors_ask_no_cpu(cls, value: Any) -> Any:
        # These actors mostly wait on I/O: setting only their ``resources`` keeps num_cpus at 0.
        if isinstance(value, dict) and "num_cpus" not in value:
            return {**value, "num_cpus": 0.0}
        return value


class PSRLConfig(Section):
    data: DataConfig = DataConfig()
    # Training rollouts.
    gen_actor_rollout_ref: ActorRolloutRefConfig = ActorRolloutRefConfig()
    # Validation rollouts.
    train_actor_rollout_ref: ActorRolloutRefConfig = ActorRolloutRefConfig()
    trainer: TrainerConfig = TrainerConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    critic: CriticConfig = CriticConfig()  # only with algorithm.advantage=gae
    transfer_queue: TransferQueueConfig = TransferQueueConfig()
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    sandbox: SandboxConfig = SandboxConfig()
    logging: LoggingConfig = LoggingConfig()
    gateway: GatewayConfig = GatewayConfig()
    sft: SFTConfig = SFTConfig()  # `psrl sft` only
    launcher: Literal["local", "ray"] = "local"
    ray: RayConfig = RayConfig()

    @model_validator(mode="after")
    def _consistent(self) -> PSRLConfig:
        from .checks import check_config

        check_config(self)
        return self
