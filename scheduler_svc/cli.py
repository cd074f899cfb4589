"""``confkv scheduler``: the client-facing gRPC Scheduler in front of running workers.

The scheduler's own command module (registered in ``confkv_serve.commands``); its flag helpers
are reused by ``confkv serve``, which sits above both services. It never imports the worker.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from confkv.cli.common import (
    UsageError,
    check_input_file,
    port_number,
    positive_int,
    require_auth_off_loopback,
)

DEFAULT_RETENTION_S = 7 * 24 * 3600  # the store's default, documented in --help and the README


def add_scheduler_args(p: argparse.ArgumentParser, port: int = 50051) -> None:
    """Flags shared by ``confkv scheduler`` and ``confkv serve``."""
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument(
        "--port", type=port_number, default=port, help="0 = any free port; a port in use is refused"
    )
    p.add_argument(
        "--http-port",
        type=port_number,
        default=None,
        help="also serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/models, /health) on "
        "this port of --host, same sessions and tokens (default: off; 0 = any free port)",
    )
    p.add_argument(
        "--redis", metavar="URL", help="session store, e.g. redis://127.0.0.1:6379/0 (default: in memory)"
    )
    p.add_argument("--redis-prefix", default="confkv:", help="key prefix in Redis")
    p.add_argument(
        "--retention",
        type=float,
        default=DEFAULT_RETENTION_S,
        help="seconds a session is kept after its last turn, then deleted "
        "(default 604800 = 7 days; 0 = forever)",
    )
    p.add_argument("--queue-limit", type=positive_int, default=64, help="turns that may wait for KV room")
    p.add_argument("--admission-timeout", type=float, default=30.0, help="seconds a turn may wait for room")
    p.add_argument(
        "--idle-ttl", type=float, default=600.0, help="idle seconds before a session's KV is freed"
    )
    p.add_argument("--default-policy", default="confkv", help="policy spec for sessions that give none")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="default reply length")
    p.add_argument(
        "--auth-token-env",
        default="CONFKV_AUTH_TOKEN",
        help="env var holding client tokens, comma-separated 'name=token' or 'token'; each is a principal "
        "that sees only its own sessions (unset = no auth, allowed on loopback only unless --insecure)",
    )
    p.add_argument(
        "--worker-token-env",
        default="CONFKV_WORKER_TOKEN",
        help="env var holding the worker token the scheduler sends to workers (different from client tokens)",
    )
    p.add_argument("--insecure", action="store_true", help="allow a non-loopback bind without client tokens")
    p.add_argument("--tls-cert", help="PEM certificate (with --tls-key: serve TLS)")
    p.add_argument("--tls-key")
    p.add_argument("--grace", type=float, default=10.0, help="seconds in-flight turns get on shutdown")


def add_parser(sub) -> None:
    p = sub.add_parser("scheduler", help="run the gRPC scheduler (sessions, placement by KV footprint)")
    p.add_argument("--workers", required=True, help="comma-separated worker addresses host:port,...")
    p.add_argument("--turn-timeout", type=float, default=600.0, help="longest a turn may stream, in seconds")
    p.add_argument("--worker-ca", help="CA certificate to verify workers' TLS (default: plaintext)")
    add_scheduler_args(p)
    p.set_defaults(run=run, extras=("serve",))


def scheduler_config(args):
    import math

    from scheduler_svc.config import SchedulerConfig

    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be >= 1")
    for flag in ("admission_timeout", "idle_ttl", "retention", "grace"):
        value = getattr(args, flag)
        if not math.isfinite(value) or value < 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be a finite number >= 0, got {value}")
    try:
        return SchedulerConfig(
            queue_limit=args.queue_limit,
            admission_timeout_s=args.admission_timeout,
            idle_ttl_s=args.idle_ttl if args.idle_ttl > 0 else None,
            default_policy=args.default_policy,
            default_max_new_tokens=args.max_new_tokens,
            turn_timeout_s=getattr(args, "turn_timeout", 600.0),
        )
    except ValueError as err:
        raise UsageError(str(err)) from None


def credentials(args) -> tuple[dict[str, str], str | None]:
    """(client token -> principal, worker token), checked: separate, and required off loopback."""
    from scheduler_svc.security import client_tokens

    clients = client_tokens(os.environ.get(args.auth_token_env))
    worker = os.environ.get(args.worker_token_env) or None
    if worker and worker in clients:
        raise UsageError(
            f"${args.worker_token_env} must differ from every client token in ${args.auth_token_env}"
        )
    require_auth_off_loopback(args.host, bool(clients), args.insecure, "the scheduler")
    return clients, worker


def check_port_free(host: str, port: int) -> None:
    import socket

    if not port:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            raise UsageError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None


def check_ports(args) -> None:
    """Both listening ports free and distinct, before anything starts (exit 2 otherwise)."""
    if args.http_port is not None and args.http_port and args.http_port == args.port:
        raise UsageError(f"--http-port {args.http_port} is also --port: use two different ports")
    check_port_free(args.host, args.port)
    if args.http_port:
        check_port_free(args.host, args.http_port)


def start_http(args, server, clients: dict[str, str], tls):
    """The HTTP front door over the running scheduler (``--http-port``), or None."""
    if args.http_port is None:
        return None
    from confkv_proto.serving import BindError

    from scheduler_svc.http import start_http_server

    try:
        return start_http_server(server.scheduler, args.host, args.http_port, clients, tls, args.grace)
    except BindError as err:
        raise UsageError(str(err)) from None


def tls_pair(args) -> tuple[str, str] | None:
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        check_input_file(path, flag)  # before anything starts (serve loads the worker after this)
    return (args.tls_cert, args.tls_key) if args.tls_cert else None


def wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


def run(args) -> int:
    from scheduler_svc.app import make_store, parse_workers, serve_scheduler

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    config = scheduler_config(args)
    workers = parse_workers(args.workers)
    clients, worker_token = credentials(args)
    tls = tls_pair(args)
    check_ports(args)
    store = make_store(args.redis, args.redis_prefix, args.retention or None)
    server = serve_scheduler(
        workers, store, config, args.host, args.port, clients, tls, args.worker_ca, worker_token
    )
    try:
        http = start_http(args, server, clients, tls)
    except BaseException:
        server.stop(0)
        raise
    if server.scheduler.store_ok is False:
        print(
            f"confkv scheduler: session store {args.redis} unreachable: NOT_SERVING until it answers",
            flush=True,
        )
    print(f"confkv scheduler listening on {server.address} (workers: {', '.join(workers)})", flush=True)
    if http is not None:
        print(f"confkv scheduler: OpenAI-compatible HTTP API on {http.url}/v1", flush=True)
    wait_for_signal()
    if http is not None:
        http.stop(args.grace)
    server.stop(args.grace)
    store.close()
    return 0
