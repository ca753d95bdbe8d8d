"""Optional third-party libraries behind the ``envs`` extra, imported only when an adapter runs.

``require("textarena", "textarena")`` returns the module, or raises :class:`MissingExtraError`
naming the extra and the pip command; nothing here is imported at ``psrl`` import time.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtraError(ImportError):
    """An adapter's library is not installed."""


def require(module: str, package: str, *, adapter: str | None = None) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if getattr(e, "name", None) not in (module, module.split(".")[0]):
            raise  # the library is there but one of its own imports failed: show that error
        who = f"the {adapter} adapter" if adapter else "this environment"
        raise MissingExtraError(
            f"{who} needs the Python package {package!r}, which is not installed; it is part of "
            f"PSRL's 'envs' extra: pip install 'psrl[envs]' (or pip install {package})"
        ) from None
