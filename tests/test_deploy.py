"""docker-compose.yml and Dockerfile, checked as far as a machine without a Docker engine allows:
the compose structure, the images' pinned torch install order, and that every service's
``confkv`` command line is accepted by the real argument parser."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from confkv_serve.commands import COMMANDS, build_parser  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
CONFKV_SERVICES = [name for name, svc in SERVICES.items() if str(svc.get("image", "")).startswith("confkv")]
_DEFAULT = re.compile(r"\$\{[A-Z_]+:-([^}]*)\}")


def _command(service: str) -> list[str]:
    """The service's argv with ``${VAR:-default}`` replaced by its default."""
    return [_DEFAULT.sub(r"\1", str(arg)) for arg in SERVICES[service]["command"]]


def _workers(profile: str) -> list[str]:
    return [name for name, svc in SERVICES.items() if svc.get("command", [None])[0] == "worker"
            and profile in svc.get("profiles", [])]  # fmt: skip


def test_compose_has_redis_scheduler_and_two_workers_per_profile():
    assert {"redis", "scheduler"} <= set(SERVICES)
    assert "profiles" not in SERVICES["redis"] and "profiles" not in SERVICES["scheduler"]
    assert len(_workers("gpu")) == 2 and len(_workers("cpu")) == 2
    for name in _workers("gpu"):
        devices = SERVICES[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert [SERVICES[n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
            for n in _workers("gpu")] == [["0"], ["1"]]  # fmt: skip
    for name in _workers("cpu"):
        assert "reservations" not in SERVICES[name].get("deploy", {}).get("resources", {})


def test_scheduler_reaches_both_workers_in_each_profile():
    cmd = _command("scheduler")
    targets = cmd[cmd.index("--workers") + 1].split(",")
    hosts = {t.rsplit(":", 1)[0] for t in targets}
    redis_url = cmd[cmd.index("--redis") + 1]
    assert redis_url.startswith("redis://redis:")
    for profile in ("gpu", "cpu"):
        aliases = set()
        for name in _workers(profile):
            aliases |= {name, *SERVICES[name]["networks"]["default"]["aliases"]}
            port = _command(name)[_command(name).index("--port") + 1]
            assert {t.rsplit(":", 1)[1] for t in targets} == {port}
        assert hosts <= aliases, f"profile {profile}: scheduler dials {hosts}, workers answer to {aliases}"
    assert SERVICES["scheduler"]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_healthchecks_are_valid_python():
    for name in CONFKV_SERVICES:
        test = SERVICES[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"]
        compile(test[3], f"{name}-healthcheck", "exec")


def test_dockerfile_pins_torch_before_the_project():
    text = (ROOT / "Dockerfile").read_text()
    torch_at = text.index("torch==2.13.0")
    assert "--index-url ${TORCH_INDEX}" in text[text.rfind("\n", 0, torch_at) : torch_at]
    assert torch_at < text.index('pip install ".[${EXTRAS}]"')
    assert 'ENTRYPOINT ["confkv"]' in text
    for name in CONFKV_SERVICES:
        assert SERVICES[name]["build"]["context"] == "."


@pytest.mark.parametrize("service", CONFKV_SERVICES)
def test_service_command_parses(service):
    cmd = _command(service)
    if cmd[0] not in COMMANDS:
        pytest.skip(f"'confkv {cmd[0]}' is not registered yet (COMMANDS={COMMANDS})")
    args = build_parser().parse_args(cmd)  # SystemExit(2) on an unknown or malformed flag
    assert args.command == cmd[0]


@pytest.mark.parametrize("command", sorted({_command(s)[0] for s in CONFKV_SERVICES}))
def test_entrypoint_starts(command):
    if command not in COMMANDS:
        pytest.skip(f"'confkv {command}' is not registered yet")
    done = subprocess.run(
        [sys.executable, "-m", "confkv_serve", command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert f"usage: confkv {command}" in done.stdout


def test_docker_compose_config_when_available():
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode:
        pytest.skip("docker compose is not installed here")
    for profile in ("gpu", "cpu"):
        done = subprocess.run(
            [docker, "compose", "--profile", profile, "config", "--quiet"], cwd=ROOT, capture_output=True
        )
        assert done.returncode == 0, done.stderr.decode()


def test_healthchecks_pass_against_running_services():
    """Each service's healthcheck command, pointed at a live worker / scheduler (tiny model)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from confkv.attention import enable
    from loadtest.capacity import start_services
    from worker_svc.codec import ByteChatCodec

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=ByteChatCodec.vocab_size, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    enable(model)
    _, worker, server = start_services(model, ByteChatCodec(), "tiny", 2**24, 256, 4, 5.0)
    ports = {"50061": worker.address.rsplit(":", 1)[1], "50051": server.address.rsplit(":", 1)[1]}
    try:
        for name in ("scheduler", _workers("cpu")[0], _workers("gpu")[0]):
            snippet = SERVICES[name]["healthcheck"]["test"][3]
            port = re.search(r"127\.0\.0\.1:(\d+)", snippet).group(1)
            snippet = snippet.replace(f"127.0.0.1:{port}", f"127.0.0.1:{ports[port]}")
            done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, f"{name}: {done.stderr[-500:]}"
    finally:
        server.stop(0.5)
        worker.stop(0.5)
