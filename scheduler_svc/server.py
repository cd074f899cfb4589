"""gRPC Scheduler servicer (translation proto <-> domain only), health service, client-token
auth (each token is a principal that owns its sessions) and TLS. ``start_scheduler`` serves
``confkv scheduler`` and ``confkv serve``. Health is NOT_SERVING while the session store is
unreachable."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import grpc
from confkv_proto import scheduler_pb2 as pb
from confkv_proto import scheduler_pb2_grpc as pb_grpc
from confkv_proto import worker_pb2
from confkv_proto.serving import TokenAuth, bind, current_principal, new_server
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from scheduler_svc.core import Scheduler
from scheduler_svc.domain import Message, QueuedEvent, SessionView, TokenEvent, TurnDone
from scheduler_svc.errors import InvalidArgument, SchedulerError
from scheduler_svc.security import server_credentials

log = logging.getLogger("confkv.scheduler")
SERVICE_NAME = "confkv.v1.Scheduler"
_FINISH = {
    "eos": worker_pb2.FINISH_REASON_EOS,
    "max_tokens": worker_pb2.FINISH_REASON_MAX_TOKENS,
    "cancelled": worker_pb2.FINISH_REASON_CANCELLED,
    "context": worker_pb2.FINISH_REASON_CONTEXT,
    "shutdown": worker_pb2.FINISH_REASON_SHUTDOWN,
}


@contextlib.contextmanager
def _status(context: grpc.ServicerContext, rpc: str):
    try:
        yield
    except SchedulerError as err:
        log.info("%s refused: %s %s", rpc, err.code, err)
        context.abort(grpc.StatusCode[err.code], str(err))


def _messages(items) -> list[Message]:
    return [Message(m.role, m.content) for m in items]


def session_proto(view: SessionView, transcript: bool) -> pb.Session:
    r = view.record
    return pb.Session(
        session_id=r.session_id,
        policy=r.policy,
        model=r.model,
        worker=view.worker,
        transcript=[worker_pb2.ChatMessage(role=m.role, content=m.content) for m in r.transcript]
        if transcript
        else [],
        created_unix_ms=int(r.created_at * 1000),
        updated_unix_ms=int(r.updated_at * 1000),
        turns=r.turns,
        kv_bytes=view.kv_bytes,
        reserved_bytes=view.reserved_bytes,
        state=view.state,
    )


def event_proto(event) -> pb.ChatEvent:
    if isinstance(event, TokenEvent):
        token = worker_pb2.TokenChunk(
            token_id=event.token_id,
            text=event.text,
            index=event.index,
            session_bytes=event.session_bytes,
            budget_tokens=event.budget_tokens,
        )
        return pb.ChatEvent(token=token)
    if isinstance(event, QueuedEvent):
        return pb.ChatEvent(queued=pb.QueuedNotice(position=event.position, reason=event.reason))
    assert isinstance(event, TurnDone)
    res = event.result
    done = worker_pb2.GenerationDone(
        reason=_FINISH.get(res.finish_reason, worker_pb2.FINISH_REASON_UNSPECIFIED),
        text=res.reply,
        prompt_tokens=res.prompt_tokens,
        generated_tokens=res.generated_tokens,
        context_tokens=res.context_tokens,
        session=worker_pb2.SessionFootprint(
            kv_bytes=res.kv_bytes, reserved_bytes=event.footprint_bytes, peak_bytes=res.peak_bytes
        ),
        seconds=res.seconds,
    )
    return pb.ChatEvent(done=done, turn=event.turn, worker=event.worker, replayed=event.replayed)


class SchedulerServicer(pb_grpc.SchedulerServicer):
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def CreateSession(self, request, context):
        with _status(context, "CreateSession"):
            who = current_principal()
            record = self.scheduler.create_session(
                request.model, request.policy, _messages(request.messages), who, request.request_id
            )
            return session_proto(self.scheduler.get_session(record.session_id, who), transcript=True)

    def Chat(self, request, context):
        gone = threading.Event()

        def went_away() -> None:  # the client cancelled or the deadline passed
            gone.set()
            self.scheduler.cluster.wake()  # a turn waiting in the admission queue leaves it now

        context.add_callback(went_away)
        with _status(context, "Chat"):
            message = Message(request.role or "user", request.content)
            events = self.scheduler.chat(
                request.session_id,
                message,
                request.max_new_tokens,
                request.temperature,
                request.seed,
                top_p=request.top_p or 1.0,
                principal=current_principal(),
                request_id=request.request_id,
                cancelled=gone,
            )
            with contextlib.closing(events):
                for event in events:
                    if gone.is_set():
                        return  # closing the turn cancels it on the worker; nothing is recorded
                    yield event_proto(event)

    def GetSession(self, request, context):
        with _status(context, "GetSession"):
            view = self.scheduler.get_session(request.session_id, current_principal())
            return session_proto(view, request.include_transcript)

    def ListSessions(self, request, context):
        with _status(context, "ListSessions"):
            size = request.page_size or 100
            token = request.page_token or "0"
            if not (token.isascii() and token.isdigit() and len(token) <= 10):
                raise InvalidArgument(f"bad page_token {request.page_token[:40]!r}")
            offset = int(token)
            views = self.scheduler.list_sessions(size, offset, current_principal())
            token = str(offset + size) if len(views) == size else ""
            return pb.ListSessionsReply(
                sessions=[session_proto(v, False) for v in views], next_page_token=token
            )

    def EndSession(self, request, context):
        with _status(context, "EndSession"):
            self.scheduler.end_session(request.session_id, current_principal())
            return pb.EndSessionReply(ended=True)

    def GetClusterStats(self, request, context):
        with _status(context, "GetClusterStats"):
            stats = self.scheduler.stats()
            workers = [
                pb.WorkerStatus(
                    address=w.address,
                    healthy=w.healthy,
                    error=w.error,
                    footprint=worker_pb2.WorkerFootprint(
                        worker_id=w.address,
                        capacity_bytes=w.capacity_bytes,
                        used_bytes=w.used_bytes,
                        reserved_bytes=w.reserved_bytes,
                        active_sessions=w.active,
                        queued_requests=w.queued,
                        open_sessions=w.sessions,
                    ),
                )
                for w in stats.workers
            ]
            return pb.ClusterStats(
                workers=workers,
                sessions=stats.sessions,
                queued=stats.queued,
                queue_capacity=stats.queue_limit,
            )


@dataclass
class SchedulerServer:
    server: grpc.Server
    scheduler: Scheduler
    health: health.HealthServicer
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, grace: float = 5.0) -> None:
        """Stop accepting calls, let in-flight turns finish for ``grace`` seconds, stop polling."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        self.scheduler.stop()

    def wait(self) -> None:
        self.server.wait_for_termination()


def start_scheduler(
    scheduler: Scheduler,
    host: str = "127.0.0.1",
    port: int = 0,
    client_tokens: Mapping[str, str] | None = None,
    tls: tuple[str, str] | None = None,
    max_threads: int = 64,
) -> SchedulerServer:
    """Start the scheduler (check the store, poll and reconcile workers) and serve it on
    ``host:port``. ``client_tokens`` maps each client's bearer token to its principal name
    (None/empty = no auth, every caller is ``anonymous``); ``tls`` is (cert_file, key_file).
    ``BindError`` when the port is in use or invalid."""
    interceptors = [TokenAuth(client_tokens)] if client_tokens else []
    server = new_server(max_threads, interceptors)
    pb_grpc.add_SchedulerServicer_to_server(SchedulerServicer(scheduler), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = bind(server, host, port, server_credentials(*tls) if tls else None)

    def set_health(ok: bool, reason: str = "") -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            health_servicer.set(name, status)

    scheduler.health_listeners.append(set_health)
    scheduler.start()
    server.start()
    set_health(bool(scheduler.store_ok))
    log.info("scheduler listening on %s:%d", host, bound)
    return SchedulerServer(server, scheduler, health_servicer, host, bound)
