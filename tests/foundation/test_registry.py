import pytest

from psrl.agent_loops import AGENT_LOOPS, resolve_components
from psrl.config import AgentConfig, NamedComponent
from psrl.environments import AGENT_DATA, ENVIRONMENTS, register_agent_data, register_env
from psrl.registry import Registry, UnknownNameError


class DottedEnv:
    """Referred to by dotted path only, never registered."""


def test_decorator_registration_and_lookup():
    reg: Registry = Registry("widget")

    @reg.register("blue")
    class Blue:
        pass

    assert reg.get("blue") is Blue
    assert "blue" in reg and reg.names() == ["blue"]
    with pytest.raises(ValueError, match="already registered"):
        reg.add("blue", object)


def test_unknown_name_lists_known_ones_and_suggests():
    reg: Registry = Registry("widget")
    reg.add("blue", object)
    reg.add("green", object)
    with pytest.raises(UnknownNameError) as e:
        reg.get("bleu")
    assert "Did you mean blue" in str(e.value) and "Known: blue, green" in str(e.value)


def test_dotted_path_fallback_and_lazy_entries():
    reg: Registry = Registry("widget")
    assert reg.get("tests.foundation.test_registry.DottedEnv") is DottedEnv
    reg.add("lazy", "tests.foundation.test_registry:DottedEnv")
    assert reg.describe("lazy") == "tests.foundation.test_registry.DottedEnv"
    assert reg.get("lazy") is DottedEnv
    with pytest.raises(UnknownNameError, match="could not be imported"):
        reg.get("no_such_pkg.Thing")


def test_builtin_names_are_registered():
    assert {"generate_only_agent", "multi_turn_agent", "multi_turn_completion_agent", "mini_swe_agent"} <= set(AGENT_LOOPS.names())
    assert {"tool_env", "mini_swe_env"} <= set(ENVIRONMENTS.names())
    assert {"tool_agent_data", "mini_swe_agent_data"} <= set(AGENT_DATA.names())


def test_row_columns_override_config_defaults():
    @register_env("test_registry_env")
    class RegisteredEnv:
        pass

    @register_agent_data("test_registry_data")
    class RegisteredData:
        pass

    @AGENT_LOOPS.register("test_registry_loop")
    class Loop:
        pass

    agent = AgentConfig(
        default_agent_loop="test_registry_loop",
        env=NamedComponent(name="test_registry_env", kwargs={"k": 1}),
        data=NamedComponent(name="test_registry_data"),
    )
    plain = resolve_components({"prompt": "x"}, agent)
    assert (plain.env_cls, plain.data_cls, plain.agent_loop_cls) == (RegisteredEnv, RegisteredData, Loop)
    assert plain.env_kwargs == {"k": 1}

    row = {"env_class": "tests.foundation.test_registry.DottedEnv", "agent_name": "test_registry_loop"}
    over = resolve_components(row, agent)
    assert over.env_cls is DottedEnv and over.env_name == "tests.foundation.test_registry.DottedEnv"
    assert over.env_kwargs == {}  # config kwargs belong to the config's env only
    assert over.data_cls is RegisteredData

    with pytest.raises(UnknownNameError, match="unknown agent loop 'nope'"):
        resolve_components({"agent_name": "nope"}, agent)
