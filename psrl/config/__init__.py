"""The typed config tree (pydantic), YAML loading and ``a.b.c=value`` overrides. No torch here."""

from .base import Section
from .data import DataConfig
from .gateway import GatewayConfig
from .loader import ConfigError, apply_overrides, from_dict, load_config, load_yaml, parse_override, to_yaml
from .logging import LoggingConfig
from .rollout import (
    ActorRolloutRefConfig,
    AgentConfig,
    EngineConfig,
    ModelConfig,
    MultiTurnConfig,
    NamedComponent,
    RolloutConfig,
    SamplingConfig,
)
from .sandbox import SandboxConfig, SandboxLimits, SandboxPoolConfig, SandboxSpec
from .schema import PSRLConfig, RayConfig
from .sft import SFTConfig
from .trainer import AlgorithmConfig, CriticConfig, LoraConfig, MoEConfig, OptimConfig, ParallelConfig, TrainerConfig
from .transfer_queue import TransferQueueConfig
from .weight_sync import WeightSyncConfig

__all__ = [
    "ActorRolloutRefConfig", "AgentConfig", "AlgorithmConfig", "ConfigError", "CriticConfig", "DataConfig",
    "EngineConfig", "GatewayConfig", "LoggingConfig", "LoraConfig", "MoEConfig", "ModelConfig", "MultiTurnConfig", "NamedComponent",
    "OptimConfig", "PSRLConfig", "ParallelConfig", "RayConfig", "RolloutConfig", "SamplingConfig",
    "SFTConfig", "SandboxConfig", "SandboxLimits", "SandboxPoolConfig", "SandboxSpec", "Section",
    "TrainerConfig", "TransferQueueConfig", "WeightSyncConfig", "apply_overrides", "from_dict", "load_config",
    "load_yaml", "parse_override", "to_yaml",
]
