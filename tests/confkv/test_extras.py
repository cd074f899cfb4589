"""A missing optional extra is one line naming it, exit code 2, before any work starts."""

from __future__ import annotations

import pytest

import confkv.extras
from confkv.extras import EXTRAS, MissingExtraError, require
from confkv_serve.commands import main


def _without(monkeypatch, *modules):
    real = confkv.extras._installed
    monkeypatch.setattr(confkv.extras, "_installed", lambda name: name not in modules and real(name))


def test_every_extra_in_pyproject_is_known():
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    declared = set(pyproject["project"]["optional-dependencies"]) - {"dev"}
    assert declared == set(EXTRAS)


def test_require_names_the_extra(monkeypatch):
    _without(monkeypatch, "scipy")
    expected = r"scipy \(the 'eval' extra\); install with pip install 'confkv\[eval\]'"
    with pytest.raises(MissingExtraError, match=expected):
        require(["serve", "eval"], "'confkv eval klshift'")
    require(["serve"], "anything")  # installed here: no error


@pytest.mark.parametrize(
    "argv, missing, extra",
    [
        (["eval", "ppl", "--text-file", "{text}", "--json", "{out}"], "matplotlib", "eval"),
        (["eval", "klshift", "--text-file", "{text}", "--json", "{out}"], "scipy", "eval"),
        (["worker", "--device", "cpu"], "grpc", "serve"),
        (["worker", "--device", "cuda"], "triton", "gpu"),
        (["scheduler", "--workers", "127.0.0.1:1"], "redis", "serve"),
        (["chat", "hi"], "grpc", "serve"),
        (["serve"], "grpc", "serve"),
    ],
)
def test_missing_extra_fails_at_start(argv, missing, extra, monkeypatch, tmp_path, capsys):
    _without(monkeypatch, missing)
    text = tmp_path / "t.txt"
    text.write_text("Some words. " * 50)
    argv = [a.format(text=text, out=tmp_path / "out.json") for a in argv]
    started = []
    monkeypatch.setattr("confkv.models.load_model", lambda *a, **k: started.append(1))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("confkv: error: ")
    assert f"pip install 'confkv[{extra}]'" in err[0] and missing in err[0]
    assert not started and not (tmp_path / "out.json").exists()


def test_recall_needs_matplotlib_only_for_its_plot(monkeypatch, tmp_path, capsys):
    _without(monkeypatch, "matplotlib")
    data = tmp_path / "items.jsonl"
    data.write_text("")
    model = tmp_path / "model"  # a folder that passes the up-front model check, then fails to load
    model.mkdir()
    (model / "config.json").write_text("{}")
    argv = ["eval", "recall", "--data", str(data), "--json", str(tmp_path / "o.json"), "--model", str(model)]
    assert main([*argv, "--trace-plot", str(tmp_path / "p.png")]) == 2
    assert "confkv[eval]" in capsys.readouterr().err
    assert main(argv) == 2  # gets past the extras check, fails on the model instead
    assert "confkv[eval]" not in capsys.readouterr().err
