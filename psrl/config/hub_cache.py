"""Hugging Face hub ids (``org/name``, ``org/name@revision``) resolved through the local HF cache.

The cache is the one every Hugging Face tool shares: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``,
else ``~/.cache/huggingface/hub``; a model lives in ``models--ORG--NAME/snapshots/COMMIT/`` and
``models--ORG--NAME/refs/REVISION`` names the commit of a branch or tag. Nothing is downloaded
unless the caller allows it (``allow_download`` or ``PSRL_ALLOW_DOWNLOAD=1``), and never while
``HF_HUB_OFFLINE`` is set. Imports nothing heavy; downloading needs ``huggingface_hub``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*)(?:@(?P<rev>[\w.\-/]+))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_TRUE = {"1", "true", "yes", "on"}


class HubModelNotFound(FileNotFoundError):
    """A hub id that is not in the local cache (and may not be downloaded)."""


def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def parse_hub_id(text: str) -> tuple[str, str] | None:
    """(repo id, revision) when ``text`` is shaped like a hub id, else None."""
    m = _HUB_ID.match(text)
    if m is None or text.startswith((".", "/", "~")) or ".." in text:
        return None
    return m.group("repo"), m.group("rev") or "main"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def _snapshot(repo_dir: Path, revision: str) -> Path | None:
    commit = revision if _COMMIT.match(revision) else None
    ref = repo_dir / "refs" / revision
    if commit is None and ref.is_file():
        commit = ref.read_text().strip()
    if commit is None:
        return None
    snap = repo_dir / "snapshots" / commit
    return snap if (snap / "config.json").is_file() else None


def resolve_hub_id(hub_id: str, *, allow_download: bool | None = None) -> str:
    """The local snapshot directory of ``hub_id``; raises :class:`HubModelNotFound` naming where
    it looked when the model is not there and may not be downloaded."""
    parsed = parse_hub_id(hub_id)
    if parsed is None:
        raise ValueError(f"{hub_id!r} is not a Hugging Face hub id (ORG/NAME or ORG/NAME@REVISION)")
    repo, revision = parsed
    cache = hf_cache_dir()
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    snap = _snapshot(repo_dir, revision)
    if snap is not None:
        return str(snap)
    if allow_download is None:
        allow_download = os.environ.get("PSRL_ALLOW_DOWNLOAD", "").strip().lower() in _TRUE
    where = f"{repo_dir}/refs/{revision} -> snapshots/<commit>/config.json"
    if not allow_download or _offline():
        why = "HF_HUB_OFFLINE is set" if _offline() else "downloads are off (set PSRL_ALLOW_DOWNLOAD=1 to allow them)"
        raise HubModelNotFound(
            f"model {hub_id!r} is not in the local Hugging Face cache (looked for {where}; the cache is $HF_HUB_CACHE, "
            f"else $HF_HOME/hub, else ~/.cache/huggingface/hub) and {why}"
        )
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise HubModelNotFound(f"model {hub_id!r} is not cached at {where}, and downloading it needs huggingface_hub") from None
    return str(snapshot_download(repo, revision=revision, cache_dir=str(cache)))
