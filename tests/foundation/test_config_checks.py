"""Cross-section config rules (psrl.config.checks): no key is silently ignored."""

import pytest

from psrl.config import ConfigError, from_dict, load_config, to_yaml

QUICKSTART = "recipes/quickstart/config.yaml"


def test_validation_model_and_engine_are_mirrored_from_generation():
    cfg = load_config(QUICKSTART, ["gen_actor_rollout_ref.rollout.engine.max_model_len=777"])
    val, gen = cfg.train_actor_rollout_ref, cfg.gen_actor_rollout_ref
    assert val.rollout.engine == gen.rollout.engine and val.rollout.engine.max_model_len == 777
    assert val.model == gen.model
    # What `psrl config show` prints loads again unchanged.
    import yaml

    again = from_dict(yaml.safe_load(to_yaml(cfg)))
    assert again == cfg


@pytest.mark.parametrize("override, key", [
    ("train_actor_rollout_ref.model.path=smollm2-135m", "train_actor_rollout_ref.model.path"),
    ("train_actor_rollout_ref.model.dtype=bfloat16", "train_actor_rollout_ref.model.dtype"),
    ("train_actor_rollout_ref.rollout.engine.max_model_len=99", "train_actor_rollout_ref.rollout.engine.max_model_len"),
    ("train_actor_rollout_ref.rollout.engine.engine_kwargs={a: 1}", "train_actor_rollout_ref.rollout.engine.engine_kwargs"),
])
def test_validation_keys_that_cannot_be_honoured_are_rejected_with_the_reason(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(QUICKSTART, [override])
    msg = str(e.value)
    assert key in msg and "training engines" in msg and "gen_actor_rollout_ref" in msg


def test_identical_validation_values_are_accepted():
    cfg = load_config(QUICKSTART, ["*.model.path=smollm2-135m", "*.rollout.engine.max_model_len=512",
                                   "train_actor_rollout_ref.rollout.engine.type=vllm"])
    assert cfg.train_actor_rollout_ref.model.path == "smollm2-135m"
    assert cfg.train_actor_rollout_ref.rollout.engine.max_model_len == 512


def test_validation_sampling_stays_its_own():
    cfg = load_config(QUICKSTART, ["train_actor_rollout_ref.rollout.sampling.n=2"])
    assert cfg.train_actor_rollout_ref.rollout.sampling.n == 2 != cfg.gen_actor_rollout_ref.rollout.sampling.n


def test_the_issue_overrides_resolve():
    cfg = load_config(QUICKSTART, ["trainer.ppo_epochs=2", "trainer.ppo_mini_batch_size=4", "algorithm.advantage=gae"])
    assert (cfg.trainer.ppo_epochs, cfg.trainer.ppo_mini_batch_size, cfg.algorithm.advantage) == (2, 4, "gae")
    assert cfg.critic.model.path is None and cfg.critic.value_clip == 0.5
    assert (cfg.algorithm.gamma, cfg.algorithm.lam, cfg.algorithm.turn_rewards) == (1.0, 1.0, False)


@pytest.mark.parametrize("override", ["critic.value_clip=0.3", "critic.optim.lr=0.01", "critic.model.path=tiny-qwen2", "critic.value_clip=null"])
def test_critic_keys_without_gae_are_rejected(override):
    with pytest.raises(ConfigError, match=r"critic\..* given but algorithm.advantage=grpo.*advantage=gae"):
        load_config(QUICKSTART, [override])
    assert load_config(QUICKSTART, [override, "algorithm.advantage=gae"]).algorithm.advantage == "gae"


@pytest.mark.parametrize("value, match", [
    (0, r"trainer.ppo_mini_batch_size: Input should be greater than or equal to 1"),
    (-2, r"trainer.ppo_mini_batch_size: Input should be greater than or equal to 1"),
    (9, r"ppo_mini_batch_size=9 is larger than the batch \(data.batch_size=8 groups\)"),
])
def test_mini_batch_size_must_be_positive_and_at_most_the_batch(value, match):
    with pytest.raises(ConfigError, match=match):
        load_config(QUICKSTART, [f"trainer.ppo_mini_batch_size={value}"])


def test_ppo_epochs_must_be_positive():
    with pytest.raises(ConfigError, match="trainer.ppo_epochs"):
        load_config(QUICKSTART, ["trainer.ppo_epochs=0"])
