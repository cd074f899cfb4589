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

from confkv.cli.common import UsageError, check_input_file, positive_int


def add_scheduler_args(p: argparse.ArgumentParser, port: int = 50051) -> None:
    """Flags shared by ``confkv scheduler`` and ``confkv serve``."""
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=positive_int, default=port, help="0 = any free port")
    p.add_argument(
        "--redis", metavar="URL", help="session store, e.g. redis://127.0.0.1:6379/0 (default: in memory)"
    )
    p.add_argument("--redis-prefix", default="confkv:", help="key prefix in Redis")
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
        help="env var holding the shared bearer token for clients and workers (unset = no auth)",
    )
    p.add_argument("--tls-cert", help="PEM certificate (with --tls-key: serve TLS)")
    p.add_argument("--tls-key")
    p.add_argument("--grace", type=float, default=10.0, help="seconds in-flight turns get on shutdown")


def add_parser(sub) -> None:
    p = sub.add_parser("scheduler", help="run the gRPC scheduler (sessions, placement by KV footprint)")
    p.add_argument("--workers", required=True, help="comma-separated worker addresses host:port,...")
    p.add_argument("--worker-ca", help="CA certificate to verify workers' TLS (default: plaintext)")
    add_scheduler_args(p)
    p.set_defaults(run=run, extras=("serve",))


def scheduler_config(args):
    from scheduler_svc.config import SchedulerConfig

    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be >= 1")
    return SchedulerConfig(
        queue_limit=args.queue_limit,
        admission_timeout_s=args.admission_timeout,
        idle_ttl_s=args.idle_ttl if args.idle_ttl > 0 else None,
        default_policy=args.default_policy,
        default_max_new_tokens=args.max_new_tokens,
    )


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
    store = make_store(args.redis, args.redis_prefix)
    token = os.environ.get(args.auth_token_env) or None
    server = serve_scheduler(
        workers, store, config, args.host, args.port, token, tls_pair(args), args.worker_ca
    )
    print(f"confkv scheduler listening on {server.address} (workers: {', '.join(workers)})", flush=True)
    wait_for_signal()
    server.stop(args.grace)
    store.close()
    return 0
