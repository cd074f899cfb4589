"""gRPC Worker servicer (translation only), health service, worker-token auth, graceful shutdown.

Only the scheduler calls a worker: it authenticates with the worker token, which is a different
credential from any client's (clients hold scheduler tokens and get UNAUTHENTICATED here).

``start_worker(...)`` builds and starts a server around an ``Engine`` and returns a
``WorkerServer`` handle (``.port``, ``.stop(grace)``): the same call serves ``confkv worker`` and
an in-process worker inside ``confkv serve``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import time
from dataclasses import dataclass
from typing import NoReturn

import grpc
from confkv_proto import worker_pb2 as pb
from confkv_proto import worker_pb2_grpc as pb_grpc
from confkv_proto.serving import BindError, TokenAuth, bind, new_server
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from confkv import limits
from worker_svc import convert
from worker_svc.engine import Engine
from worker_svc.observability import WorkerMetrics
from worker_svc.types import (
    InternalError,
    InvalidRequest,
    PoolExhausted,
    SessionBusy,
    SessionExists,
    SessionNotFound,
    ShuttingDown,
    TurnDone,
    TurnFailed,
    WorkerError,
)

log = logging.getLogger("confkv.worker")
SERVICE_NAME = "confkv.v1.Worker"
CODES = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    SessionNotFound: grpc.StatusCode.NOT_FOUND,
    SessionExists: grpc.StatusCode.ALREADY_EXISTS,
    SessionBusy: grpc.StatusCode.FAILED_PRECONDITION,
    PoolExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    InternalError: grpc.StatusCode.INTERNAL,  # this turn failed in the engine; the worker is fine
}


def _abort(context: grpc.ServicerContext, err: WorkerError, rpc: str) -> NoReturn:
    code = CODES.get(type(err), grpc.StatusCode.INTERNAL)
    log.info("rpc refused", extra={"rpc": rpc, "code": code.name, "reason": str(err)})
    context.abort(code, str(err))
    raise AssertionError("context.abort raises")  # pragma: no cover


@contextlib.contextmanager
def _domain_errors(context: grpc.ServicerContext, rpc: str):
    try:
        yield
    except WorkerError as err:
        _abort(context, err, rpc)


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, engine: Engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def Describe(self, request, context):
        cfg, geo = self.engine.config, self.engine.geometry
        return pb.WorkerInfo(
            worker_id=cfg.worker_id,
            model=self.model_name,
            kv_pool_bytes=cfg.kv_pool_bytes,
            fp_token_bytes=geo.fp_token_bytes * geo.n_layers,
            int8_token_bytes=geo.int8_token_bytes * geo.n_layers,
            num_layers=geo.n_layers,
            max_context_tokens=cfg.max_context_tokens,
            max_batch_size=cfg.max_batch_size,
            max_message_chars=limits.MAX_MESSAGE_CHARS,
            max_queue=cfg.max_queue,
            default_policy=cfg.default_policy,
            num_kv_heads=geo.n_kv_heads,
            head_dim=geo.head_dim,
            dtype_bytes=geo.dtype_bytes,
            max_new_tokens_limit=cfg.max_new_tokens_limit,
            max_transcript_chars=limits.transcript_char_limit(cfg.max_context_tokens),
        )

    def OpenSession(self, request, context):
        with _domain_errors(context, "OpenSession"):
            report = self.engine.open_session(
                request.session_id, request.policy, convert.messages_from_proto(request.transcript)
            )
            return pb.OpenSessionReply(session=convert.session_to_proto(report))

    def Generate(self, request, context):
        with _domain_errors(context, "Generate"):
            handle = self.engine.submit(convert.turn_request(request))
        context.add_callback(handle.cancel)  # client cancel / deadline / disconnect stops the turn
        while True:
            try:
                event = handle.get(timeout=0.1)
            except queue.Empty:
                if not context.is_active():
                    handle.cancel()
                    return
                continue
            if isinstance(event, TurnFailed):
                _abort(context, event.error, "Generate")
            yield convert.event_to_proto(event)
            if isinstance(event, TurnDone):
                return

    def DropSession(self, request, context):
        with _domain_errors(context, "DropSession"):
            return pb.DropSessionReply(
                freed_bytes=self.engine.drop(request.session_id, request.release_kv_only)
            )

    def EstimateBytes(self, request, context):
        with _domain_errors(context, "EstimateBytes"):
            est = self.engine.estimate(
                request.policy,
                convert.messages_from_proto(request.transcript),
                request.context_tokens,
                request.max_new_tokens,
            )
            return convert.estimate_to_proto(est)

    def GetFootprint(self, request, context):
        return convert.footprint_to_proto(self.engine.footprint(request.include_sessions))

    def WatchFootprint(self, request, context):
        if not 0 <= request.interval_ms <= 3_600_000:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "interval_ms must be in [0, 3600000]")
        interval = (request.interval_ms or 1000) / 1000
        while context.is_active():
            yield convert.footprint_to_proto(self.engine.footprint(request.include_sessions))
            deadline = time.monotonic() + interval
            while context.is_active() and time.monotonic() < deadline:
                time.sleep(min(0.05, interval))


@dataclass
class WorkerServer:
    server: grpc.Server
    engine: Engine
    health: health.HealthServicer
    port: int
    host: str
    metrics: WorkerMetrics | None = None
    metrics_port: int | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, grace: float = 5.0) -> None:
        """Stop taking turns, let in-flight ones finish for ``grace`` s (then cancel them), close."""
        self.health.enter_graceful_shutdown()
        self.engine.stop(grace)
        self.server.stop(grace=1.0).wait()
        if self.metrics is not None:
            self.metrics.close()
        log.info("worker stopped", extra={"address": self.address})

    def wait(self) -> None:
        self.server.wait_for_termination()


def start_worker(
    engine: Engine,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 0,
    metrics_port: int | None = None,
    auth_token: str | None = None,
    tls: tuple[bytes, bytes] | None = None,
    max_threads: int = 64,
) -> WorkerServer:
    """Start the engine loop and a gRPC server on ``host:port`` (0 = any free port).
    ``auth_token`` is the worker token the scheduler sends; ``BindError`` when the port is in use
    or invalid (nothing is started then)."""
    interceptors = [TokenAuth({auth_token: "scheduler"})] if auth_token else []
    server = new_server(max_threads, interceptors)
    pb_grpc.add_WorkerServicer_to_server(WorkerServicer(engine, model_name), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    credentials = grpc.ssl_server_credentials([(tls[1], tls[0])]) if tls is not None else None  # (key, cert)
    bound = bind(server, host, port, credentials)
    metrics = WorkerMetrics(engine.config.worker_id, engine.used_bytes, engine.prompts.stats)
    engine.on_step = metrics.on_step
    try:
        metrics_bound = metrics.serve(metrics_port, host) if metrics_port is not None else None
    except OSError as err:
        server.stop(0)
        raise BindError(f"cannot serve metrics on {host}:{metrics_port}: {err}") from None
    engine.start()
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("worker listening", extra={"address": f"{host}:{bound}", "model": model_name,
                                        "kv_pool_bytes": engine.config.kv_pool_bytes})  # fmt: skip
    return WorkerServer(server, engine, health_servicer, bound, host, metrics, metrics_bound)
