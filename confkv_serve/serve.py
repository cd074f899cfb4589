"""``confkv serve``: scheduler + one in-process worker: the embedded default deployment.

Sessions live in memory unless ``--redis URL``. ``--demo`` starts everything, runs a two-turn
chat through the scheduler, prints it with the session's KV footprint, and exits.

It starts both services, so it lives above both (``confkv_serve``), never inside either."""

from __future__ import annotations

import logging
import secrets
import sys

from confkv.cli.common import add_model_arg
from scheduler_svc.cli import (
    add_scheduler_args,
    check_ports,
    credentials,
    scheduler_config,
    start_http,
    tls_pair,
    wait_for_signal,
)

DEMO_TURNS = ("What is the capital of France? Answer in one sentence.", "Name a famous museum there.")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="scheduler + one in-process worker (in-memory sessions unless --redis)")
    add_model_arg(p)
    p.add_argument("--kv-pool-bytes", default="256MiB", help="the worker's KV pool, e.g. 256MiB, 2GB")
    p.add_argument(
        "--host-pool-bytes",
        default=None,
        help="host memory for the cold tiers of recall=1 sessions, e.g. 8GiB (default: no limit)",
    )
    p.add_argument("--demo", action="store_true", help="run a two-turn chat through the scheduler and exit")
    add_scheduler_args(p)
    p.set_defaults(run=run, extras=serve_extras)


def serve_extras(args) -> tuple[str, ...]:
    from worker_svc.cli import needs_triton

    return ("serve", "gpu") if needs_triton("auto") else ("serve",)


def run_demo(address: str, token: str | None, policy: str, max_new_tokens: int, out=sys.stdout) -> int:
    from confkv_serve.chat import stream_turn
    from scheduler_svc.client import SchedulerClient

    client = SchedulerClient(address, token)
    try:
        session = client.create_session(policy, system="You are a concise assistant.")
        print(f"session {session.session_id} (policy {session.policy}, model {session.model})", file=out)
        for text in DEMO_TURNS:
            print(f"\nuser: {text}\nassistant: ", end="", file=out, flush=True)
            done = stream_turn(client, session.session_id, text, max_new_tokens, out=out, err=out)
            if done is None:
                return 1
        stats = client.stats()
        for w in stats.workers:
            f = w.footprint
            # the scheduler's view, polled every few hundred ms: it can lag the turn's own figure
            # (the session's KV at its last token, printed with each reply above)
            print(
                f"worker {w.address}: KV {f.used_bytes} / {f.capacity_bytes} bytes in use "
                "(its last footprint report to the scheduler, all sessions)",
                file=out,
            )
        client.end_session(session.session_id)
    finally:
        client.close()
    return 0


def run(args) -> int:
    from scheduler_svc.app import make_store, serve_scheduler
    from worker_svc.app import create_engine, parse_bytes, start_worker

    logging.basicConfig(level=logging.WARNING if args.demo else logging.INFO)
    config = scheduler_config(args)
    pool = parse_bytes(args.kv_pool_bytes)
    host_pool = parse_bytes(args.host_pool_bytes) if args.host_pool_bytes is not None else None
    tls = tls_pair(args)
    clients, worker_token = credentials(args)
    worker_token = worker_token or secrets.token_urlsafe(24)  # only our scheduler may call our worker
    if not args.demo:
        check_ports(args)
    store = make_store(args.redis, args.redis_prefix, args.retention or None)
    engine = create_engine(
        args.model,
        pool,
        default_policy=args.default_policy,
        default_max_new_tokens=args.max_new_tokens,
        worker_id="in-process",
        host_pool_bytes=host_pool,
    )
    worker = start_worker(engine, args.model, "127.0.0.1", 0, None, worker_token, None)
    port = 0 if args.demo else args.port
    try:
        server = serve_scheduler(
            [worker.address], store, config, args.host, port, clients, tls, None, worker_token
        )
    except BaseException:
        worker.stop(1.0)
        raise
    http = None
    try:
        if not args.demo:
            http = start_http(args, server, clients, tls)
        if args.demo:
            client_token = next(iter(clients), None)
            return run_demo(server.address, client_token, args.default_policy, min(args.max_new_tokens, 40))
        pools = f"KV pool {pool} bytes" + ("" if host_pool is None else f", host pool {host_pool} bytes")
        print(f"confkv serve: scheduler on {server.address}, worker {worker.address} ({pools})")
        if http is not None:
            print(f"confkv serve: OpenAI-compatible HTTP API on {http.url}/v1")
        sys.stdout.flush()
        wait_for_signal()
        return 0
    finally:
        if http is not None:
            http.stop(args.grace)
        server.stop(args.grace if not args.demo else 1.0)
        worker.stop(1.0)
        store.close()
