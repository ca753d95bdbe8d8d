import subprocess
import sys

import yaml


def psrl(*args):
    return subprocess.run([sys.executable, "-m", "psrl.cli", *args], capture_output=True, text=True, timeout=120)


def test_help_lists_commands():
    out = psrl("--help")
    assert out.returncode == 0
    for cmd in ("train", "rollout", "bench", "envs", "config", "models"):
        assert cmd in out.stdout


def test_config_show_resolves_star_override():
    out = psrl("config", "show", "recipes/quickstart/config.yaml", "*.rollout.multi_turn.max_turns=3")
    assert out.returncode == 0, out.stderr
    tree = yaml.safe_load(out.stdout)
    assert tree["gen_actor_rollout_ref"]["rollout"]["multi_turn"]["max_turns"] == 3
    assert tree["train_actor_rollout_ref"]["rollout"]["multi_turn"]["max_turns"] == 3


def test_misspelt_key_exits_2_naming_the_right_key():
    out = psrl("config", "show", "recipes/quickstart/config.yaml", "gen_actor_rollout_ref.rollout.multi_turn.max_turn=3")
    assert out.returncode == 2
    assert "max_turns" in out.stderr and "Traceback" not in out.stderr


def test_missing_recipe_exits_2_without_traceback():
    out = psrl("config", "show", "missing.yaml")
    assert out.returncode == 2
    assert "missing.yaml" in out.stderr and "Traceback" not in out.stderr


def test_envs_lists_builtins():
    out = psrl("envs")
    assert out.returncode == 0
    for name in ("generate_only_agent", "multi_turn_agent", "tool_env", "tool_agent_data", "hermes"):
        assert name in out.stdout
