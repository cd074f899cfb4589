"""``confkv eval ...`` end to end on a tiny local model folder, and its usage errors (exit 2)."""

from __future__ import annotations

import json

import pytest

from confkv_serve.commands import main

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 40


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "novel.txt"
    path.write_text(TEXT)
    return path


@pytest.mark.parametrize(
    "argv, message",
    [
        (["ppl", "--text-file", "{text}", "--policies", "nope", "--json", "{out}"], "unknown policy"),
        (["ppl", "--text-file", "{missing}", "--policies", "full", "--json", "{out}"], "not found"),
        (["ppl", "--text-file", "{text}", "--policies", "full,full", "--json", "{out}"], "duplicate"),
        (["ppl", "--text-file", "{text}", "--json", "{md}"], ".md"),
        (
            [
                "ppl",
                "--text-file",
                "{text}",
                "--policies",
                "full",
                "--match-bytes",
                "full",
                "--json",
                "{out}",
            ],
            "evicting",
        ),
        (["ablation", "--text-file", "{text}", "--policy", "window", "--json", "{out}"], "confkv spec"),
        (["recall", "--data", "{missing}", "--json", "{out}"], "not found"),
        (["niah", "--haystack", "{text}", "--depths", "1.5", "--json", "{out}"], "depths"),
        (["klshift", "--text-file", "{text}", "--tokens", "100", "--json", "{out}"], "--recent"),
    ],
)
def test_usage_errors_exit_2(argv, message, text_file, tmp_path, chat_model_dir, capsys):
    subs = {
        "{text}": str(text_file),
        "{missing}": str(tmp_path / "missing"),
        "{out}": str(tmp_path / "o.json"),
    }
    subs["{md}"] = str(tmp_path / "o.md")
    argv = [subs.get(a, a) for a in argv]
    try:
        code = main(["eval", *argv, "--model", str(chat_model_dir), "--no-progress"])
    except SystemExit as exc:  # argparse-level errors (bad spec in a typed argument)
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_missing_json_is_an_argparse_error(text_file):
    with pytest.raises(SystemExit) as exc:
        main(["eval", "ppl", "--text-file", str(text_file)])
    assert exc.value.code == 2


def test_ppl_cli_writes_json_markdown_and_plot(text_file, tmp_path, chat_model_dir):
    out = tmp_path / "ppl.json"
    argv = ["eval", "ppl", "--model", str(chat_model_dir), "--text-file", str(text_file), "--tokens", "40"]
    argv += ["--policies", "full,window:n=16,confkv:p=4,s=2,int8=1,w=4", "--match-bytes", "window:n=16"]
    assert main([*argv, "--json", str(out), "--no-progress", "--checkpoint-every", "13"]) == 0
    payload = json.loads(out.read_text())
    partial = json.loads(out.with_suffix(".partial.json").read_text())
    assert partial["tokens"] == 27 and partial["partial_of"] == 40  # checkpoints after 13 and 26 scored
    assert payload["tokens"] == 40 and payload["model"] == str(chat_model_dir)
    assert set(payload["results"]) == {"full", "window:n=16", "confkv:p=4,s=2,int8=1,w=4"}
    for r in payload["results"].values():
        assert {"ppl", "peak_kv_bytes", "mean_kv_bytes", "seconds"} <= set(r)
    assert "| full |" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 1000


def test_niah_cli_runs_generated_items(text_file, tmp_path, chat_model_dir):
    out = tmp_path / "niah.json"
    argv = ["eval", "niah", "--model", str(chat_model_dir), "--haystack", str(text_file)]
    argv += ["--lengths", "128", "--depths", "0.5", "--policies", "full,window:n=64", "--max-new-tokens", "2"]
    argv += ["--save-items", str(tmp_path / "items.jsonl"), "--trace-plot", str(tmp_path / "trace.png")]
    assert main([*argv, "--json", str(out), "--no-progress"]) == 0
    payload = json.loads(out.read_text())
    assert set(payload["results"]) == {"full", "window:n=64"}
    assert payload["results"]["full"]["items"] == 1
    assert (tmp_path / "items.jsonl").read_text().count("\n") == 1
    assert (tmp_path / "trace.png").stat().st_size > 1000


def test_results_are_written_before_the_plot(text_file, tmp_path, chat_model_dir, monkeypatch):
    """A plot that fails (e.g. matplotlib broken) loses nothing: JSON and markdown are on disk first."""
    import confkv.eval.plots

    def broken_plot(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'matplotlib'")

    monkeypatch.setattr(confkv.eval.plots, "frontier_plot", broken_plot)
    out = tmp_path / "ppl.json"
    argv = ["eval", "ppl", "--model", str(chat_model_dir), "--text-file", str(text_file), "--tokens", "20"]
    with pytest.raises(ModuleNotFoundError):
        main([*argv, "--policies", "full", "--json", str(out), "--no-progress"])
    assert json.loads(out.read_text())["results"]["full"]["ppl"] > 0
    assert out.with_suffix(".md").is_file() and not out.with_suffix(".png").exists()
