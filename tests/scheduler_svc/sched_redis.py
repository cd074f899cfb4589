"""Helpers for tests that need Redis: a unique key prefix on the shared server (cleaned up), and
a private throw-away redis-server that tests can stop and start."""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import time

import pytest

SHARED_URL = "redis://127.0.0.1:6379/0"


def shared_redis_or_skip():
    import redis

    client = redis.Redis.from_url(SHARED_URL, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.exceptions.ConnectionError:
        pytest.skip("Redis is not running at 127.0.0.1:6379")
    return client


def unique_prefix() -> str:
    return f"test:confkv-sched:{secrets.token_hex(4)}:"


def delete_prefix(client, prefix: str) -> None:
    keys = list(client.scan_iter(match=prefix + "*"))
    if keys:
        client.delete(*keys)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrivateRedis:
    """``redis-server --port P --save ''`` that a test may stop and start again (same port)."""

    def __init__(self) -> None:
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--bind",
                "127.0.0.1",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("private redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None
