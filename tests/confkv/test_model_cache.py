"""The embedded model's converted folder: built once, even by processes that start together."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from confkv import models


@pytest.fixture
def fake_convert(monkeypatch, tmp_path):
    """smollm2_dir over a temporary cache, with a slow fake conversion that counts its calls."""
    monkeypatch.setenv("CONFKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "smollm2_gguf", lambda: tmp_path / "model.gguf")
    calls: list[Path] = []

    def convert(gguf: Path, out: Path) -> None:
        calls.append(out)
        time.sleep(0.2)  # long enough for the other callers to arrive while it runs
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(models, "_convert", convert)
    return calls


def test_callers_that_start_together_convert_once_and_all_get_the_folder(fake_convert):
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(models.smollm2_dir())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fake_convert) == 1
    assert len(got) == 3 and len(set(got)) == 1
    assert (got[0] / "model.safetensors").read_bytes() == b"weights"
    assert [p.name for p in got[0].parent.iterdir() if p.name.startswith(".smollm2-")] == []  # no temp left


def test_a_finished_folder_is_reused_and_a_partial_one_replaced(fake_convert):
    first = models.smollm2_dir()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert models.smollm2_dir() == first and len(fake_convert) == 1
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # never rewritten under a reader
    (first / "model.safetensors").unlink()  # as an interrupted older version could leave it
    assert models.smollm2_dir() == first and len(fake_convert) == 2
    assert (first / "model.safetensors").is_file()


def test_a_failed_conversion_leaves_no_folder_and_the_next_call_retries(fake_convert, monkeypatch):
    def broken(gguf: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise models.ModelNotFoundError("loading the GGUF default model needs gguf")

    monkeypatch.setattr(models, "_convert", broken)
    with pytest.raises(models.ModelNotFoundError, match="needs gguf"):
        models.smollm2_dir()
    target = models.cache_root() / "smollm2-135m-instruct"
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir() if p.name.startswith(".smollm2-")] == []
