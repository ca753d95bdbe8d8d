"""YAML + dotted overrides -> a validated :class:`PSRLConfig`.

One override parser: ``a.b.c=value`` where value is a YAML scalar or flow list/map. A leading
``*.`` applies the key to both rollout sub-trees. Errors carry the full dotted path.
"""

from __future__ import annotations

import copy
import difflib
import os
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from .schema import PSRLConfig

ROLLOUT_SUBTREES = ("gen_actor_rollout_ref", "train_actor_rollout_ref")


class ConfigError(ValueError):
    """A config that cannot be loaded. The message names the dotted path and what was wrong."""


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping, got {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not of the form a.b.c=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML: {e}") from None
    parts = key.split(".")
    if any(not p for p in parts):
        raise ConfigError(f"override {text!r}: empty component in key {key!r}")
    return parts, value


def _set(tree: dict, parts: Sequence[str], value: Any, origin: str) -> None:
    node = tree
    for i, part in enumerate(parts[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        elif not isinstance(nxt, dict):
            path = ".".join(parts[: i + 1])
            raise ConfigError(f"override {origin!r}: {path} is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def apply_overrides(tree: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    out = copy.deepcopy(dict(tree))
    for text in overrides:
        parts, value = parse_override(text)
        if parts[0] == "*":
            for sub in ROLLOUT_SUBTREES:
                _set(out, [sub, *parts[1:]], value, text)
        else:
            _set(out, parts, value, text)
    return out


def _model_at(path: Sequence[str | int]) -> type[BaseModel] | None:
    """The pydantic model class that owns the last key of ``path`` (for suggestions)."""
    model: Any = PSRLConfig
    for part in path[:-1]:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        model = _unwrap(field.annotation)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _unwrap(tp: Any) -> Any:
    for arg in typing.get_args(tp) or ():
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return tp


def _format_error(err: Mapping[str, Any]) -> str:
    loc = [str(p) for p in err["loc"]]
    path = ".".join(loc)
    if err["type"] == "extra_forbidden":
        owner = _model_at(loc)
        names = list(owner.model_fields) if owner else []
        close = difflib.get_close_matches(loc[-1], names, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        valid = f" (valid keys here: {', '.join(names)})" if names else ""
        return f"unknown key {path}{hint}{valid}"
    if not loc:  # a rule across sections (psrl.config.checks): the message names the keys
        return str(err["msg"]).removeprefix("Value error, ")
    value = err.get("input")
    return f"{path}: {err['msg']} (got {value!r})"


def from_dict(tree: Mapping[str, Any]) -> PSRLConfig:
    try:
        return PSRLConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError("invalid config:\n  " + "\n  ".join(_format_error(x) for x in e.errors())) from None


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> PSRLConfig:
    """Load a recipe YAML (or the defaults when ``path`` is None) and apply dotted overrides."""
    tree = load_yaml(path) if path is not None else {}
    return from_dict(apply_overrides(tree, overrides))


def to_yaml(cfg: PSRLConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
