"""Assembly used by the CLI: store + worker clients + scheduler + gRPC server."""

from __future__ import annotations

from collections.abc import Mapping

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core import Scheduler
from scheduler_svc.grpc_worker import GrpcWorkerClient
from scheduler_svc.server import SchedulerServer, start_scheduler
from scheduler_svc.store import DEFAULT_RETENTION_S, MemoryStore, SessionStore
from scheduler_svc.store_redis import RedisStore


def make_store(
    redis_url: str | None, prefix: str = "confkv:", retention_s: float | None = DEFAULT_RETENTION_S
) -> SessionStore:
    """Redis when a URL is given, else in-memory. An unreachable Redis is not fatal: the
    scheduler reports NOT_SERVING and turns get UNAVAILABLE until it is back."""
    if not redis_url:
        return MemoryStore(retention_s)
    if not redis_url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"--redis expects a URL like redis://127.0.0.1:6379/0, got {redis_url!r}")
    return RedisStore(redis_url, prefix=prefix, retention_s=retention_s)


def parse_workers(text: str) -> list[str]:
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    if not addresses:
        raise ValueError("--workers needs at least one host:port")
    for address in addresses:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"worker address must be host:port, got {address!r}")
    if len(set(addresses)) != len(addresses):
        raise ValueError("--workers lists an address twice")
    return addresses


def serve_scheduler(
    workers: list[str],
    store: SessionStore,
    config: SchedulerConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    client_tokens: Mapping[str, str] | None = None,
    tls: tuple[str, str] | None = None,
    worker_ca: str | None = None,
    worker_token: str | None = None,
) -> SchedulerServer:
    """``client_tokens``: token -> principal for callers; ``worker_token``: the separate
    credential the scheduler presents to workers (never accepted from a client)."""
    if worker_token and client_tokens and worker_token in client_tokens:
        raise ValueError("the worker token must differ from every client token")
    clients = [
        GrpcWorkerClient(a, token=worker_token, ca_file=worker_ca, turn_timeout_s=config.turn_timeout_s)
        for a in workers
    ]
    return start_scheduler(Scheduler(store, clients, config), host, port, client_tokens, tls)
