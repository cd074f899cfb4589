"""Issue 14: every class of bad input ends in ONE line ``confkv: error: ...`` and exit code 2,
before any work (no model load, no remote call, no traceback), and quickly."""

from __future__ import annotations

import json
import time

import pytest

from confkv import models
from confkv_serve.commands import main

UNREACHABLE = "127.0.0.1:1"  # a chat that got as far as a remote call would fail differently (exit 1)


def run(argv, capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse-level errors
        code = exc.code
    err = capsys.readouterr().err
    return code, err


def assert_one_line_error(code, err, *fragments):
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("confkv: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr(models, "_hub_reachable", lambda timeout_s=1.5: False)


@pytest.mark.parametrize(
    "argv, fragments",
    [
        # 14.3: unchecked values
        (["generate", "--prompt", "hi", "--temperature", "nan"], ["--temperature", "finite"]),
        (["generate", "--prompt", "hi", "--temperature", "inf"], ["--temperature", "finite"]),
        (["generate", "--prompt", "hi", "--temperature", "-1"], ["--temperature", ">= 0"]),
        (["generate", "--prompt", "hi", "--max-new-tokens", "99999999999999999999"], ["--max-new-tokens"]),
        (["generate", "--prompt", "hi", "--max-new-tokens", "2000000"], ["--max-new-tokens", "tokens"]),
        (["chat", "--address", UNREACHABLE, ""], ["empty message"]),
        (["chat", "--address", UNREACHABLE, "   "], ["empty message"]),
        (["chat", "--address", UNREACHABLE, "--max-new-tokens", "99999999999999999999", "hi"], ["--max"]),
        (["chat", "--address", UNREACHABLE, "--policy", "lru", "hi"], ["unknown policy"]),
        (["chat", "--address", UNREACHABLE, "--ca", "/no/ca.pem", "hi"], ["--ca", "not found"]),
        (["plan", "--utilization", "nan"], ["--utilization"]),
        (["plan", "--memory", "1e400"], ["memory '1e400'"]),  # read as infinity: once an OverflowError
        # 14.4: outputs and inputs checked before the work
        (["generate", "--prompt", "hi", "--trace", "/no/dir/t.json"], ["--trace", "/no/dir"]),
        (["plan", "--json", "/no/dir/p.json"], ["--json", "/no/dir"]),
        (["plan", "--trace", "/no/t.json"], ["--trace", "not found"]),
        (["serve", "--tls-cert", "/no/c.pem", "--tls-key", "/no/k.pem"], ["--tls-cert", "not found"]),
        (["scheduler", "--workers", "127.0.0.1:1", "--tls-cert", "/no/c.pem", "--tls-key", "/no/k"], ["tls"]),
        # 14.5: unknown models
        (["generate", "--prompt", "hi", "--model", "no-such-model-xyz"], ["no-such-model-xyz", "smollm2"]),
        (["generate", "--prompt", "hi", "--model", "./no/such/folder"], ["no local folder"]),
        (["eval", "ppl", "--text-file", "x", "--json", "o.json", "--model", "a/b/c"], ["no local folder"]),
    ],
)
def test_bad_input_is_one_line_exit_2(argv, fragments, capsys, offline, monkeypatch):
    monkeypatch.setattr("sys.stdin", open("/dev/null"))  # noqa: SIM115
    started = time.perf_counter()
    code, err = run(argv, capsys)
    assert_one_line_error(code, err, *fragments)
    assert time.perf_counter() - started < 10  # never after a model load or hub retries


def test_eval_outputs_checked_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import confkv.models

    text = tmp_path / "t.txt"
    text.write_text("Some words. " * 50)
    monkeypatch.setattr(confkv.models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    bad_plot = ["--json", str(tmp_path / "x.json"), "--plot", "/no/d/p.png"]
    for extra in (["--json", "/no/dir/x.json"], bad_plot):
        code, err = run(["eval", "ppl", "--text-file", str(text), "--policies", "full", *extra], capsys)
        assert_one_line_error(code, err, "does not exist")
    code, err = run(["eval", "niah", "--haystack", str(text), "--json", str(tmp_path / "n.json"),
                     "--save-items", "/no/d/i.jsonl"], capsys)  # fmt: skip
    assert_one_line_error(code, err, "--save-items")


def test_chat_blank_stdin_creates_no_session(capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("\n   \n\n"))
    code, err = run(["chat", "--address", UNREACHABLE], capsys)
    assert_one_line_error(code, err, "no message")


def test_unknown_model_offline_is_fast_and_names_what_was_looked_for(offline):
    started = time.perf_counter()
    with pytest.raises(models.ModelNotFoundError) as err:
        models.locate("no-such-model-xyz")
    assert time.perf_counter() - started < 2
    message = str(err.value)
    assert "\n" not in message
    for looked_for in ("'smollm2'", "local folder", "HF cache", "unreachable"):
        assert looked_for in message


def test_model_folder_without_config(tmp_path):
    with pytest.raises(models.ModelNotFoundError, match="no config.json"):
        models.locate(str(tmp_path))


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "(default: 64)" in out and "(default: confkv)" in out


def test_full_trace_budget_is_null_and_plan_reads_it(tmp_path):
    from confkv.cli.generate import readable_step
    from confkv.plan import TraceSummary

    step = readable_step({"step": 0, "budget": 4611686018427387904, "kv_bytes": 10})
    assert step["budget"] is None
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"model": "m", "policy": "full", "peak_kv_bytes": 10, "steps": [step]}))
    assert TraceSummary.load(trace).high_share == 1.0
