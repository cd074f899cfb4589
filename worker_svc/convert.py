"""Proto <-> domain translation for the worker servicer (the only place both meet)."""

from __future__ import annotations

import time

from confkv_proto import worker_pb2 as pb

from worker_svc.types import (
    ChatMessage,
    Estimate,
    FinishReason,
    Footprint,
    SessionReport,
    SessionState,
    TokenEvent,
    TurnDone,
    TurnRequest,
)

FINISH = {
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.MAX_TOKENS: pb.FINISH_REASON_MAX_TOKENS,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.CONTEXT: pb.FINISH_REASON_CONTEXT,
    FinishReason.SHUTDOWN: pb.FINISH_REASON_SHUTDOWN,
}
STATE = {
    SessionState.IDLE: pb.SESSION_STATE_IDLE,
    SessionState.QUEUED: pb.SESSION_STATE_QUEUED,
    SessionState.PREFILL: pb.SESSION_STATE_PREFILL,
    SessionState.DECODE: pb.SESSION_STATE_DECODE,
}


def messages_from_proto(messages) -> tuple[ChatMessage, ...]:
    return tuple(ChatMessage(m.role or "user", m.content) for m in messages)


def turn_request(request: pb.GenerateRequest) -> TurnRequest:
    return TurnRequest(
        session_id=request.session_id,
        messages=messages_from_proto(request.messages),
        max_new_tokens=request.max_new_tokens,
        temperature=request.temperature,
        seed=request.seed,
        top_p=request.top_p or 1.0,
        request_id=request.request_id,
    )


def session_to_proto(report: SessionReport) -> pb.SessionFootprint:
    return pb.SessionFootprint(
        session_id=report.session_id,
        policy=report.policy,
        state=STATE[report.state],
        kv_bytes=report.kv_bytes,
        reserved_bytes=report.reserved_bytes,
        peak_bytes=report.peak_bytes,
        budget_tokens=report.budget_tokens,
        cached_tokens=report.cached_tokens,
        context_tokens=report.context_tokens,
        turns=report.turns,
        cold_bytes=report.cold_bytes,
    )


def footprint_to_proto(fp: Footprint) -> pb.WorkerFootprint:
    return pb.WorkerFootprint(
        worker_id=fp.worker_id,
        capacity_bytes=fp.capacity_bytes,
        used_bytes=fp.used_bytes,
        reserved_bytes=fp.reserved_bytes,
        active_sessions=fp.active_sessions,
        queued_requests=fp.queued_requests,
        open_sessions=fp.open_sessions,
        batch_size=fp.batch_size,
        tokens_per_second=fp.tokens_per_second,
        sessions=[session_to_proto(s) for s in fp.sessions],
        unix_ms=int(time.time() * 1000),
        draining=fp.draining,
        host_capacity_bytes=fp.host_capacity_bytes,
        host_used_bytes=fp.host_used_bytes,
        host_reserved_bytes=fp.host_reserved_bytes,
    )


def event_to_proto(event: TokenEvent | TurnDone) -> pb.GenerateEvent:
    if isinstance(event, TokenEvent):
        return pb.GenerateEvent(
            token=pb.TokenChunk(
                token_id=event.token_id,
                text=event.text,
                index=event.index,
                session_bytes=event.session_bytes,
                budget_tokens=event.budget_tokens,
            )
        )
    return pb.GenerateEvent(
        done=pb.GenerationDone(
            reason=FINISH[event.reason],
            text=event.text,
            prompt_tokens=event.prompt_tokens,
            generated_tokens=event.generated_tokens,
            context_tokens=event.context_tokens,
            session=session_to_proto(event.session),
            seconds=event.seconds,
            queued_seconds=event.queued_seconds,
        )
    )


def estimate_to_proto(est: Estimate) -> pb.EstimateBytesReply:
    return pb.EstimateBytesReply(
        worst_case_bytes=est.worst_case_bytes,
        policy_bound_bytes=est.policy_bound_bytes,
        resolved_policy=est.resolved_policy,
        context_tokens=est.context_tokens,
        fits_pool=est.fits_pool,
    )
