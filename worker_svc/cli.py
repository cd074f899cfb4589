"""``confkv worker``: host a model and many sessions' Conf-KV caches behind the gRPC Worker API.

The worker's own command module (registered in ``confkv_serve.commands``); it imports only the
core library and this service, never the scheduler.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from confkv.cli.common import UsageError, add_model_arg, port_number, positive_int, require_auth_off_loopback


def add_parser(sub) -> None:
    p = sub.add_parser("worker", help="run a gRPC worker (model + sessions' KV caches, batched decode)")
    add_model_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument(
        "--port", type=port_number, default=50061, help="0 = any free port; a port in use is refused"
    )
    p.add_argument("--kv-pool-bytes", default="256MiB", help="KV pool, e.g. 268435456, 256MiB, 2GB")
    p.add_argument(
        "--host-pool-bytes",
        default=None,
        help="host memory for the cold tiers of recall=1 sessions, e.g. 8GiB (default: no limit)",
    )
    p.add_argument(
        "--no-demote-idle",
        dest="demote_idle",
        action="store_false",
        help="under KV-pool pressure release idle recall=1 sessions instead of demoting their hot "
        "cache to the cold tier (the next turn then re-reads the conversation)",
    )
    p.add_argument(
        "--torch-linears",
        dest="onednn_linears",
        action="store_false",
        help="run the model's linears through PyTorch's F.linear on the CPU instead of oneDNN",
    )
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"], help="model dtype")
    p.add_argument("--policy", default="confkv", help="default policy spec for sessions that give none")
    p.add_argument("--max-batch", type=positive_int, default=16, help="sequences per decode step")
    p.add_argument("--max-queue", type=positive_int, default=64, help="turns waiting for room")
    p.add_argument("--prefill-chunk", type=positive_int, default=256, help="prompt tokens per chunk")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="default reply length")
    p.add_argument("--max-context", type=positive_int, default=0, help="0 = the model's positions")
    p.add_argument("--worker-id", default="", help="name in footprints and metrics (default host:port)")
    p.add_argument("--metrics-port", type=port_number, help="serve Prometheus metrics on this port")
    p.add_argument("--auth-token-env", default="CONFKV_WORKER_TOKEN",
                   help="env var holding the worker token: only the scheduler may call the worker "
                        "(unset = no auth, allowed on loopback only unless --insecure)")  # fmt: skip
    p.add_argument("--insecure", action="store_true", help="allow a non-loopback bind without a token")
    p.add_argument("--tls-cert", type=Path, help="PEM certificate (with --tls-key: serve TLS)")
    p.add_argument("--tls-key", type=Path)
    p.add_argument("--grace", type=float, default=10.0, help="seconds in-flight turns get on shutdown")
    p.add_argument("--log-format", choices=["json", "text"], default="json")
    p.set_defaults(run=run, extras=worker_extras)


def needs_triton(device: str) -> bool:
    """True when the model will run on CUDA, where attention takes the Triton path."""
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


def worker_extras(args) -> tuple[str, ...]:
    return ("serve", "gpu") if needs_triton(args.device) else ("serve",)


def run(args) -> int:
    from confkv.policies import parse_policy
    from worker_svc.app import create_engine, parse_bytes, start_worker
    from worker_svc.observability import configure_logging

    parse_policy(args.policy)  # a clear error before the model loads
    pool = parse_bytes(args.kv_pool_bytes)
    host_pool = parse_bytes(args.host_pool_bytes) if args.host_pool_bytes is not None else None
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
    token = os.environ.get(args.auth_token_env) or None
    require_auth_off_loopback(args.host, token is not None, args.insecure, "the worker")
    for path in (args.tls_cert, args.tls_key):
        if path is not None and not path.is_file():
            raise UsageError(f"TLS file not found: {path}")
    tls = (args.tls_cert.read_bytes(), args.tls_key.read_bytes()) if args.tls_cert else None
    _check_ports_free(args.host, args.port, args.metrics_port)
    configure_logging(fmt=args.log_format)
    config = dict(
        max_batch_size=args.max_batch, max_queue=args.max_queue, prefill_chunk=args.prefill_chunk,
        default_max_new_tokens=args.max_new_tokens, default_policy=args.policy,
        worker_id=args.worker_id or f"{args.host}:{args.port}", demote_idle=args.demote_idle,
        onednn_linears=args.onednn_linears, host_pool_bytes=host_pool,
    )  # fmt: skip
    if args.max_context:
        config["max_context_tokens"] = args.max_context
    engine = create_engine(args.model, pool, device=args.device, dtype=args.dtype, **config)
    worker = start_worker(
        engine,
        args.model,
        args.host,
        args.port,
        args.metrics_port,
        token,
        tls,
    )
    print(f"confkv worker listening on {worker.address} (KV pool {pool} bytes)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    worker.stop(args.grace)
    return 0


def _check_ports_free(host: str, *ports: int | None) -> None:
    """Fail fast (before loading the model) on a port another process holds."""
    import socket

    for port in ports:
        if not port:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not "in use"
            try:
                sock.bind((host, port))
            except OSError as err:
                raise UsageError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
