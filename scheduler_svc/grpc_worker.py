"""``WorkerClient`` over gRPC: translates the Worker service (proto) to the scheduler's domain
types and its status codes to the scheduler's domain errors."""

from __future__ import annotations

import threading
from collections.abc import Generator

import grpc
from confkv_proto import worker_pb2, worker_pb2_grpc

from confkv.memory import KVGeometry
from scheduler_svc.domain import Message, Sampling, TokenEvent, TurnResult, WorkerReport
from scheduler_svc.errors import (
    Conflict,
    InvalidArgument,
    NotFound,
    SchedulerError,
    TurnFailed,
    WorkerRefused,
    WorkerUnavailable,
)
from scheduler_svc.security import auth_metadata, channel

_FINISH = {
    worker_pb2.FINISH_REASON_EOS: "eos",
    worker_pb2.FINISH_REASON_MAX_TOKENS: "max_tokens",
    worker_pb2.FINISH_REASON_CANCELLED: "cancelled",
    worker_pb2.FINISH_REASON_CONTEXT: "context",
    worker_pb2.FINISH_REASON_SHUTDOWN: "shutdown",
}


def geometry_from_info(info) -> KVGeometry:
    """The worker's KV geometry as it reports it (WorkerInfo), checked against its byte totals."""
    try:
        geometry = KVGeometry(info.num_layers, info.num_kv_heads, info.head_dim, info.dtype_bytes)
    except (ValueError, TypeError) as err:
        raise WorkerUnavailable(f"worker reported an invalid KV geometry: {err}") from None
    if geometry.fp_token_bytes * geometry.n_layers != info.fp_token_bytes or info.num_kv_heads <= 0:
        raise WorkerUnavailable(
            f"worker reported inconsistent KV sizes (geometry {geometry}, fp={info.fp_token_bytes})"
        )
    return geometry


def _domain_error(err: grpc.RpcError, address: str) -> SchedulerError:
    code, details = err.code(), err.details() or ""
    message = f"worker {address}: {details}"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return WorkerRefused(message)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(message)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(message)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return Conflict(message)
    if code == grpc.StatusCode.INTERNAL:  # that turn failed; the worker answered, it is alive
        return TurnFailed(f"worker {address} failed this turn; it was not recorded, send it again")
    return WorkerUnavailable(f"worker {address} failed ({code.name}): {details}")


class GrpcWorkerClient:
    def __init__(
        self,
        address: str,
        token: str | None = None,
        ca_file: str | None = None,
        timeout_s: float = 10.0,
        turn_timeout_s: float = 600.0,
    ) -> None:
        self.address = address
        self._turn_timeout = turn_timeout_s
        self._calls: set[grpc.Future] = set()
        self._calls_lock = threading.Lock()
        self._channel = channel(address, ca_file)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self._metadata = auth_metadata(token)
        self._timeout = timeout_s
        self._info: worker_pb2.WorkerInfo | None = None

    def _call(self, method, request, timeout: float | None = None):
        try:
            return method(request, timeout=timeout or self._timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self._info = None  # it may come back as a different process
            raise _domain_error(err, self.address) from None

    def report(self) -> WorkerReport:
        if self._info is None:
            self._info = self._call(self._stub.Describe, worker_pb2.DescribeRequest(), timeout=3.0)
        info = self._info
        assert info is not None  # set just above
        fp = self._call(
            self._stub.GetFootprint, worker_pb2.FootprintRequest(include_sessions=True), timeout=3.0
        )
        return WorkerReport(
            address=self.address,
            model=info.model,
            geometry=geometry_from_info(info),
            max_context=info.max_context_tokens,
            capacity_bytes=fp.capacity_bytes,
            used_bytes=fp.used_bytes,
            session_bytes={s.session_id: s.kv_bytes for s in fp.sessions},
            active=fp.active_sessions,
            queued=fp.queued_requests,
            max_transcript_chars=info.max_transcript_chars,
            host_capacity_bytes=fp.host_capacity_bytes,
            host_used_bytes=fp.host_used_bytes,
            session_cold_bytes={s.session_id: s.cold_bytes for s in fp.sessions if s.cold_bytes},
        )

    def open(self, session_id: str, policy: str, transcript: list[Message]) -> None:
        request = worker_pb2.OpenSessionRequest(
            session_id=session_id,
            policy=policy,
            transcript=[worker_pb2.ChatMessage(role=m.role, content=m.content) for m in transcript],
        )
        try:
            self._call(self._stub.OpenSession, request)
        except SchedulerError as err:
            if "exist" not in str(err).lower():
                raise
            # A stale copy from before a restart: the stored transcript is the truth.
            self.drop(session_id)
            self._call(self._stub.OpenSession, request)

    def turn(
        self, session_id: str, message: Message, sampling: Sampling, request_id: str = ""
    ) -> Generator[TokenEvent | TurnResult, None, None]:
        request = worker_pb2.GenerateRequest(
            session_id=session_id,
            messages=[worker_pb2.ChatMessage(role=message.role, content=message.content)],
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            seed=sampling.seed,
            top_p=sampling.top_p,
            request_id=request_id,
        )
        call = self._stub.Generate(request, metadata=self._metadata, timeout=self._turn_timeout)
        with self._calls_lock:
            self._calls.add(call)
        try:
            for event in call:
                if event.HasField("token"):
                    t = event.token
                    yield TokenEvent(t.text, t.token_id, t.index, t.session_bytes, t.budget_tokens)
                elif event.HasField("done"):
                    yield _turn_result(event.done)
                    return
        except grpc.RpcError as err:
            raise _domain_error(err, self.address) from None
        finally:
            call.cancel()  # no-op when finished; stops generation when the caller went away
            with self._calls_lock:
                self._calls.discard(call)

    def cancel_calls(self) -> None:
        with self._calls_lock:
            calls = list(self._calls)
        for call in calls:
            call.cancel()

    def drop(self, session_id: str) -> None:
        self._call(self._stub.DropSession, worker_pb2.DropSessionRequest(session_id=session_id))

    def close(self) -> None:
        self._channel.close()


def _turn_result(done) -> TurnResult:
    return TurnResult(
        reply=done.text,
        finish_reason=_FINISH.get(done.reason, "unspecified"),
        prompt_tokens=done.prompt_tokens,
        generated_tokens=done.generated_tokens,
        context_tokens=done.context_tokens,
        kv_bytes=done.session.kv_bytes,
        peak_bytes=done.session.peak_bytes,
        seconds=done.seconds,
    )
