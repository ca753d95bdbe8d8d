"""Name -> class registries: plain dicts filled by a decorator, imported lazily.

A name maps to an object or to a ``"module:attr"`` path imported on first use. Any
``package.module.Class`` path is accepted as a name too. An unknown name raises an error that
lists the known ones.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; this one reads as a sentence
        return str(self.args[0])


def import_path(path: str) -> Any:
    """Import ``pkg.mod:attr`` or ``pkg.mod.attr``."""
    if ":" in path:
        module, _, attr = path.partition(":")
    else:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ImportError(f"{path!r} is not a dotted path to a class or function")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T | str] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@ENVIRONMENTS.register("my_env")``."""

        def deco(obj: T) -> T:
            self.add(name, obj)
            return obj

        return deco

    def add(self, name: str, obj: T | str) -> None:
        """Add an object, or a ``"module:attr"`` string imported when first asked for."""
        old = self._entries.get(name)
        if old is not None and old is not obj and not isinstance(old, str):
            raise ValueError(f"{self.kind} {name!r} is already registered as {old!r}")
        self._entries[name] = obj

    def get(self, name: str) -> T:
        entry = self._entries.get(name)
        if entry is None:
            if "." in name or ":" in name:
                try:
                    return import_path(name)
                except (ImportError, AttributeError) as e:
                    raise UnknownNameError(f"{self.kind} {name!r} could not be imported: {e}") from None
            close = difflib.get_close_matches(name, list(self._entries), n=3, cutoff=0.5)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}.{hint} Known: {', '.join(sorted(self._entries)) or '(none)'};"
                " or give a dotted path such as my_pkg.module.MyClass"
            )
        if isinstance(entry, str):
            entry = import_path(entry)
            self._entries[name] = entry
        return entry

    def names(self) -> list[str]:
        return sorted(self._entries)

    def describe(self, name: str) -> str:
        """Where an entry lives, without importing it."""
        entry = self._entries[name]
        if isinstance(entry, str):
            return entry.replace(":", ".")
        return f"{getattr(entry, '__module__', '?')}.{getattr(entry, '__qualname__', repr(entry))}"

    def __contains__(self, name: str) -> bool:
        return name in self._entries
