import pytest

from psrl.config import ConfigError, PSRLConfig, apply_overrides, load_config, parse_override
from psrl.config.rollout import MultiTurnConfig

QUICKSTART = "recipes/quickstart/config.yaml"


def test_defaults_load_and_every_component_gets_its_own_subtree():
    cfg = load_config()
    assert isinstance(cfg, PSRLConfig)
    assert isinstance(cfg.gen_actor_rollout_ref.rollout.multi_turn, MultiTurnConfig)
    # The two rollout subtrees are distinct objects: changing one leaves the other alone.
    cfg.gen_actor_rollout_ref.rollout.multi_turn.max_turns = 7
    assert cfg.train_actor_rollout_ref.rollout.multi_turn.max_turns != 7


def test_star_override_sets_both_rollout_subtrees():
    cfg = load_config(QUICKSTART, ["*.rollout.multi_turn.max_turns=3", "*.rollout.multi_turn.enable=true"])
    for sub in (cfg.gen_actor_rollout_ref, cfg.train_actor_rollout_ref):
        assert sub.rollout.multi_turn.max_turns == 3
        assert sub.rollout.multi_turn.enable is True


def test_values_parse_as_yaml_scalars_and_lists():
    cfg = load_config(None, ["data.train_files=[a.parquet, b.parquet]", "trainer.optim.lr=3e-6", "gen_actor_rollout_ref.rollout.sampling.seed=null"])
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.trainer.optim.lr == pytest.approx(3e-6)
    assert cfg.gen_actor_rollout_ref.rollout.sampling.seed is None


def test_later_override_wins():
    cfg = load_config(None, ["trainer.total_steps=3", "trainer.total_steps=5"])
    assert cfg.trainer.total_steps == 5


def test_unknown_key_names_full_path_and_closest_match():
    with pytest.raises(ConfigError) as e:
        load_config(QUICKSTART, ["gen_actor_rollout_ref.rollout.multi_turn.max_turn=3"])
    msg = str(e.value)
    assert "gen_actor_rollout_ref.rollout.multi_turn.max_turn" in msg
    assert "did you mean max_turns" in msg


def test_unknown_top_level_section():
    with pytest.raises(ConfigError, match=r"unknown key trainr; did you mean trainer"):
        load_config(None, ["trainr.total_steps=1"])


def test_wrong_type_names_path_expected_type_and_value():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.total_steps=many"])
    msg = str(e.value)
    assert "trainer.total_steps" in msg and "integer" in msg and "'many'" in msg


def test_bad_enum_value_lists_choices():
    with pytest.raises(ConfigError, match=r"trainer.mode.*'sync', 'one_step_off' or 'async'"):
        load_config(None, ["trainer.mode=fast"])


def test_override_into_a_value_is_an_error():
    with pytest.raises(ConfigError, match="trainer.total_steps is a value, not a section"):
        apply_overrides({"trainer": {"total_steps": 1}}, ["trainer.total_steps.x=1"])


@pytest.mark.parametrize("bad", ["noequals", "=3", "a..b=1"])
def test_malformed_override(bad):
    with pytest.raises(ConfigError):
        parse_override(bad)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(listy)


def test_assignment_is_validated():
    cfg = load_config()
    with pytest.raises(Exception):
        cfg.trainer.total_steps = "x"
