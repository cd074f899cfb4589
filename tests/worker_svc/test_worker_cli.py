"""``confkv worker`` argument handling (no model is loaded for bad usage) and byte sizes."""

from __future__ import annotations

import pytest

from confkv_serve.commands import main
from worker_svc.app import parse_bytes
from worker_svc.types import MAX_POOL_BYTES, EngineConfig


@pytest.mark.parametrize(
    "text, value",
    [
        ("268435456", 268435456), ("256MiB", 256 << 20), ("1.5GB", 1_500_000_000), ("1e6", 10**6),
        ("2E3KiB", 2000 << 10),  # an upper-case exponent, as confkv plan --memory takes it
        (str(MAX_POOL_BYTES), MAX_POOL_BYTES),  # exact, not rounded through a float
    ],
)  # fmt: skip
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize(
    "text",
    ["banana", "0", "-5MiB", "12 parsecs", "", "1e400", "1e30GiB", str(MAX_POOL_BYTES + 1), "9" * 400],
)
def test_parse_bytes_rejects(text):
    """Sizes past int64 are refused (1e400 reads as infinity; 400 digits once raised
    OverflowError): a pool the worker cannot report in its footprint once made Describe and
    GetFootprint fail with INTERNAL."""
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_engine_config_refuses_pools_past_int64():
    for name in ("kv_pool_bytes", "host_pool_bytes"):
        with pytest.raises(ValueError, match=name):
            EngineConfig(**{"kv_pool_bytes": 1 << 20, name: MAX_POOL_BYTES + 1})


@pytest.mark.parametrize(
    "argv, message",
    [
        (["worker", "--kv-pool-bytes", "banana"], "not a byte size"),
        (["worker", "--port", "0", "--kv-pool-bytes", "1e400"], "too large"),
        (["worker", "--port", "0", "--host-pool-bytes", "1e400"], "too large"),
        (["worker", "--port", "0", "--host-pool-bytes", "1e30GiB"], "too large"),
        (["worker", "--port", "0", "--host-pool-bytes", "-5"], "not a byte size"),
        (["worker", "--port", "0", "--host-pool-bytes", "0"], "must be positive"),
        (["serve", "--kv-pool-bytes", "1e400"], "too large"),
        (["serve", "--host-pool-bytes", "-5"], "not a byte size"),
        (["serve", "--host-pool-bytes", "0"], "must be positive"),
        (["worker", "--policy", "confkv:n_high=oops"], "not a valid int"),
        (["worker", "--tls-cert", "/nonexistent.pem"], "--tls-cert and --tls-key go together"),
    ],
)
def test_worker_usage_errors_exit_2(argv, message, capsys, monkeypatch):
    import worker_svc.app as app

    monkeypatch.setattr(app, "create_engine", lambda *a, **k: pytest.fail("the model loaded"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def engine_config_of(argv, monkeypatch) -> dict:
    """The engine config a command builds from ``argv``, with no model loaded: the engine
    factory is replaced and stops the command once it has the config."""
    import worker_svc.app as app

    seen: dict = {}

    class Stop(Exception):
        pass

    def fake_create_engine(model, pool, **config):
        seen.update(config)
        raise Stop

    monkeypatch.setattr(app, "create_engine", fake_create_engine)
    with pytest.raises(Stop):
        main(argv)
    return seen


@pytest.mark.parametrize("argv, onednn", [([], True), (["--torch-linears"], False)])
def test_worker_linears_flag_reaches_the_engine_config(argv, onednn, monkeypatch):
    """``--torch-linears`` turns ``EngineConfig.onednn_linears`` off."""
    config = engine_config_of(["worker", "--port", "0", *argv], monkeypatch)
    assert config["onednn_linears"] is onednn


@pytest.mark.parametrize("argv, host_pool", [([], None), (["--host-pool-bytes", "2MiB"], 2 << 20)])
def test_serve_host_pool_reaches_its_worker(argv, host_pool, monkeypatch):
    """``confkv serve --host-pool-bytes`` bounds its in-process worker's cold tiers as
    ``confkv worker --host-pool-bytes`` does; without it the worker has no host limit."""
    config = engine_config_of(["serve", "--port", "0", *argv], monkeypatch)
    assert config["host_pool_bytes"] == host_pool
