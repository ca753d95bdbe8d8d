"""The rollout sub-tree, repeated for training (``gen_actor_rollout_ref``) and validation
(``train_actor_rollout_ref``) rollouts."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .base import Section


class ModelConfig(Section):
    # A local HF directory, one of the offline test models ("tiny-qwen2", "smollm2-135m"), or a
    # hub id ("org/name", "org/name@rev") already in the local HF cache (downloads: PSRL_ALLOW_DOWNLOAD=1).
    path: str = "tiny-qwen2"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    max_tokens: int = Field(256, ge=1)
    n: int = Field(1, ge=1)  # episodes per task: the GRPO group size
    stop: list[str] = []
    stop_token_ids: list[int] = []
    seed: int | None = None


class MultiTurnConfig(Section):
    """Limits of one episode. The multi-turn loops (``multi_turn_agent``,
    ``multi_turn_completion_agent``) need ``enable: true``; ``generate_only_agent`` ignores it."""

    enable: bool = False
    max_turns: int = Field(4, ge=1)
    max_response_length: int = Field(1024, ge=1)  # response tokens over all turns, observations included
    episode_timeout_s: float = Field(300.0, gt=0)  # past it the episode is FAILED (env and request released)


class NamedComponent(Section):
    """A registered name (or ``module.Class`` path) and the keyword arguments it is built with."""

    name: str
    kwargs: dict[str, Any] = {}


class AgentConfig(Section):
    default_agent_loop: str = "generate_only_agent"
    env: NamedComponent = NamedComponent(name="tool_env")
    data: NamedComponent = NamedComponent(name="tool_agent_data")
    tool_parser: str = "hermes"  # a TOOL_PARSERS name (hermes, qwen, any vLLM 0.32 name: `psrl envs`) or a dotted path
    max_concurrency: int = Field(64, ge=1)  # episodes running at once in one rollout runner
    # What happens to a GRPO group in which an episode failed: keep the rest, or drop the group.
    on_failure: Literal["keep_group", "drop_group"] = "drop_group"


class EngineConfig(Section):
    """The rollout engines: ``replicas`` vLLM engines behind a ``Router``.

    The model (path, dtype) comes from the sibling ``model`` section, sampling defaults from
    ``rollout.sampling``. ``engine_kwargs`` pass through to vLLM's ``AsyncEngineArgs``.
    """

    # "scripted" is psrl.testing.ScriptedEngine, which tests build directly; make_engine builds vllm.
    type: Literal["vllm", "scripted"] = "vllm"
    replicas: int = Field(1, ge=1)
    max_model_len: int = Field(2048, ge=16)
    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0)
    cpu_kv_cache_gb: float = Field(2.0, gt=0.0)  # KV cache size when vLLM runs on CPU
    enforce_eager: bool = True
    max_num_seqs: int = Field(64, ge=1)
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = Field(1, ge=1)
    seed: int = 0
    # Sessions remembered for sticky routing (least recently used ones are forgotten first).
    max_sticky_sessions: int = Field(100_000, ge=1)
    engine_kwargs: dict[str, Any] = {}


class RolloutConfig(Section):
    engine: EngineConfig = EngineConfig()
    sampling: SamplingConfig = SamplingConfig()
    multi_turn: MultiTurnConfig = MultiTurnConfig()
    agent: AgentConfig = AgentConfig()


class ActorRolloutRefConfig(Section):
    model: ModelConfig = ModelConfig()
    rollout: RolloutConfig = RolloutConfig()
