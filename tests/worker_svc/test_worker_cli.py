"""``confkv worker`` argument handling (no model is loaded for bad usage) and byte sizes."""

from __future__ import annotations

import pytest

from confkv_serve.commands import main
from worker_svc.app import parse_bytes


@pytest.mark.parametrize(
    "text, value", [("268435456", 268435456), ("256MiB", 256 << 20), ("1.5GB", 1_500_000_000), ("1e6", 10**6)]
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["banana", "0", "-5MiB", "12 parsecs", ""])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["worker", "--kv-pool-bytes", "banana"], "not a byte size"),
        (["worker", "--policy", "confkv:n_high=oops"], "not a valid int"),
        (["worker", "--tls-cert", "/nonexistent.pem"], "--tls-cert and --tls-key go together"),
    ],
)
def test_worker_usage_errors_exit_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, onednn", [([], True), (["--torch-linears"], False)])
def test_worker_linears_flag_reaches_the_engine_config(argv, onednn, monkeypatch):
    """``--torch-linears`` turns ``EngineConfig.onednn_linears`` off (no model is loaded: the
    engine factory is replaced and stops the command once it has the config)."""
    import worker_svc.app as app

    seen = {}

    class Stop(Exception):
        pass

    def fake_create_engine(model, pool, **config):
        seen.update(config)
        raise Stop

    monkeypatch.setattr(app, "create_engine", fake_create_engine)
    with pytest.raises(Stop):
        main(["worker", "--port", "0", *argv])
    assert seen["onednn_linears"] is onednn
