"""``model.path`` as a Hugging Face hub id, resolved through a local HF cache laid out offline."""

from __future__ import annotations

import shutil

import pytest

from psrl.config.hub_cache import HubModelNotFound, parse_hub_id
from psrl.models import model_dir, resolve_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
pytestmark = pytest.mark.timeout(60)


def _cache(root, repo="acme/tiny-chat", commit=COMMIT, ref="main"):
    """The HF cache layout: models--ORG--NAME/snapshots/COMMIT/... and refs/REF naming COMMIT."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in model_dir("tiny-qwen2").iterdir():
        if not f.name.startswith("."):
            shutil.copy2(f, snap / f.name)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.delenv("PSRL_ALLOW_DOWNLOAD", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


def test_hub_id_resolves_to_the_cached_snapshot_and_loads(hf_cache):
    snap = _cache(hf_cache)
    assert resolve_model_path("acme/tiny-chat") == str(snap)
    assert resolve_model_path("acme/tiny-chat@main") == str(snap)
    assert resolve_model_path(f"acme/tiny-chat@{COMMIT}") == str(snap)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path("acme/tiny-chat"))
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("acme/tiny-chat"))
    assert model.config.vocab_size == 832 and tok.chat_template


def test_a_missing_hub_id_names_where_it_looked(hf_cache, monkeypatch):
    _cache(hf_cache)
    with pytest.raises(HubModelNotFound) as e:
        resolve_model_path("acme/other")
    assert str(hf_cache / "models--acme--other") in str(e.value) and "HF_HUB_OFFLINE" in str(e.value)
    with pytest.raises(HubModelNotFound, match="refs/v2"):
        resolve_model_path("acme/tiny-chat@v2")
    # Downloads are opt-in, and HF_HUB_OFFLINE wins over the opt-in.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(HubModelNotFound, match="PSRL_ALLOW_DOWNLOAD=1"):
        resolve_model_path("acme/other")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("PSRL_ALLOW_DOWNLOAD", "1")
    with pytest.raises(HubModelNotFound, match="HF_HUB_OFFLINE is set"):
        resolve_model_path("acme/other")


def test_cache_location_follows_hf_home_and_local_directories_win(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snap = _cache(tmp_path / "hf" / "hub", repo="org/m")
    assert resolve_model_path("org/m") == str(snap)
    local = tmp_path / "org" / "m"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("org/m") == "org/m"  # an existing relative directory is a path
    with pytest.raises(FileNotFoundError, match="neither a local directory"):
        resolve_model_path("./nowhere")
    assert parse_hub_id("Qwen/Qwen2.5-0.5B-Instruct@refs/pr/1") == ("Qwen/Qwen2.5-0.5B-Instruct", "refs/pr/1")
    assert parse_hub_id("/abs/path") is None and parse_hub_id("a/b/c") is None and parse_hub_id("../x") is None
