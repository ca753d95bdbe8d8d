"""Write a new environment package: Environment, AgentData, a tiny dataset, a conformance test
and a recipe that runs it. Templates are files next to this module; ``__NAME__`` and
``__CLASS__`` in them become the package name and the class-name prefix."""

from __future__ import annotations

import keyword
import re
from pathlib import Path

TEMPLATES = Path(__file__).with_name("templates")
# template file -> path in the new package
FILES = {
    "init.py.tmpl": "__init__.py",
    "env.py.tmpl": "env.py",
    "agent_data.py.tmpl": "agent_data.py",
    "train.jsonl.tmpl": "data/train.jsonl",
    "recipe.yaml.tmpl": "recipe.yaml",
    "tests_init.py.tmpl": "tests/__init__.py",
    "test_env.py.tmpl": "tests/test___NAME__.py",
    "README.md.tmpl": "README.md",
}


def _class_prefix(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def scaffold(name: str, directory: str | Path = ".", *, force: bool = False) -> Path:
    """Write the package ``directory/name``; returns its path. ``name`` must be a Python
    identifier (it is imported as ``name.env``); an existing directory is an error unless
    ``force``."""
    if not re.fullmatch(r"[a-z_][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise ValueError(f"environment name {name!r} must be a lowercase Python identifier (letters, digits, _), e.g. my_env")
    root = Path(directory) / name
    if root.exists() and not force:
        raise FileExistsError(f"{root} exists already; choose another name or remove it")
    for template, target in FILES.items():
        text = (TEMPLATES / template).read_text()
        text = text.replace("__NAME__", name).replace("__CLASS__", _class_prefix(name))
        path = root / target.replace("__NAME__", name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root
