"""Engine config and the factory's checks: all caught before any engine starts."""

from __future__ import annotations

import json

import pytest

from psrl.config import ConfigError, EngineConfig, ModelConfig, RolloutConfig, SamplingConfig, load_config
from psrl.engines import SamplingParams, make_engine, sampling_from_config
from psrl.engines.vllm_args import check_cpu_head_size, engine_args

pytestmark = pytest.mark.timeout(60)


def test_engine_config_loads_from_dotted_overrides():
    cfg = load_config(
        overrides=[
            "gen_actor_rollout_ref.rollout.engine.replicas=3",
            "gen_actor_rollout_ref.rollout.engine.cpu_kv_cache_gb=0.5",
            "gen_actor_rollout_ref.rollout.engine.max_model_len=4096",
        ]
    )
    engine = cfg.gen_actor_rollout_ref.rollout.engine
    assert (engine.replicas, engine.cpu_kv_cache_gb, engine.max_model_len) == (3, 0.5, 4096)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("replicas=0", "gen_actor_rollout_ref.rollout.engine.replicas"),
        ("type=sglang", "gen_actor_rollout_ref.rollout.engine.type"),
        ("gpu_memory_utilization=1.5", "gen_actor_rollout_ref.rollout.engine.gpu_memory_utilization"),
        ("cpu_kv_cache_gb=0", "gen_actor_rollout_ref.rollout.engine.cpu_kv_cache_gb"),
        ("max_model_len=8", "gen_actor_rollout_ref.rollout.engine.max_model_len"),
        ("max_num_seq=4", "unknown key gen_actor_rollout_ref.rollout.engine.max_num_seq"),
    ],
)
def test_bad_engine_config_fails_at_load_naming_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(overrides=[f"gen_actor_rollout_ref.rollout.engine.{override}"])


def test_factory_refuses_types_it_does_not_build():
    with pytest.raises(ValueError, match="make_engine builds: vllm.*ScriptedEngine"):
        make_engine(RolloutConfig(engine=EngineConfig(type="scripted")), ModelConfig())


def test_unknown_engine_kwargs_are_named(vllm_model_path):
    cfg = EngineConfig(engine_kwargs={"max_num_batched_tokens": 512, "no_such_arg": 1})
    with pytest.raises(ValueError, match=r"\['no_such_arg'\]"):
        engine_args(cfg, vllm_model_path, "float32")
    args = engine_args(EngineConfig(engine_kwargs={"max_num_batched_tokens": 512}), vllm_model_path, "float32")
    assert args.max_num_batched_tokens == 512
    assert args.worker_extension_cls == "psrl.engines.worker_ext.WeightUpdateExtension"


def test_a_head_size_vllm_cpu_cannot_run_is_named_before_start(tmp_path):
    config = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="attention head size 16; vLLM on CPU supports head sizes"):
        check_cpu_head_size(str(tmp_path))


def test_sampling_defaults_come_from_the_rollout_config():
    cfg = SamplingConfig(temperature=0.7, top_p=0.9, max_tokens=64, stop=["</s>"], stop_token_ids=[2], seed=5)
    assert sampling_from_config(cfg) == SamplingParams(
        temperature=0.7, top_p=0.9, top_k=-1, max_tokens=64, stop=("</s>",), stop_token_ids=(2,), seed=5
    )
    assert sampling_from_config(cfg, max_tokens=8).max_tokens == 8
