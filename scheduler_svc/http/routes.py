"""Route handlers (translation only): ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health``. The work happens in ``ChatService`` on a turn thread."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pydantic
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from scheduler_svc.core import ANONYMOUS
from scheduler_svc.domain import QueuedEvent, TokenEvent, TurnDone
from scheduler_svc.http.errors import ApiError
from scheduler_svc.http.pump import FINISHED, TurnPump
from scheduler_svc.http.responses import DONE, Completion, sse
from scheduler_svc.http.schemas import ChatCompletionRequest, TurnRequest, to_turn, validation_error
from scheduler_svc.http.service import SESSION_HEADER, ChatService, Resolved

router = APIRouter()


@dataclass
class HttpState:
    """What the handlers share (``app.state.confkv``)."""

    service: ChatService
    authenticate: object  # Callable[[str], str | None]: Authorization header -> principal
    max_body_bytes: int
    draining: bool = False


def state(request: Request) -> HttpState:
    return request.app.state.confkv


def principal(request: Request) -> str:
    """The caller's principal from ``Authorization: Bearer <token>`` (``anonymous`` without auth)."""
    authenticate = state(request).authenticate
    if authenticate is None:
        return ANONYMOUS
    name = authenticate(request.headers.get("authorization", ""))  # type: ignore[operator]
    if name is None:
        raise ApiError(
            401, "missing or wrong API key (Authorization: Bearer <token>)", code="invalid_api_key"
        )
    return name


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past ``limit`` bytes (before reading it all)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body exceeds {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_request(body: bytes) -> TurnRequest:
    try:
        req = ChatCompletionRequest.model_validate_json(body)
    except pydantic.ValidationError as err:
        if any(e.get("type") == "json_invalid" for e in err.errors()):
            raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None
        raise validation_error(err.errors()) from None  # type: ignore[arg-type]
    return to_turn(req)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, who: str = Depends(principal)) -> Response:
    st = state(request)
    turn = parse_request(await read_body(request, st.max_body_bytes))
    session_id = request.headers.get(SESSION_HEADER) or None
    pump = TurnPump(st.service.scheduler.cluster.wake)
    pump.start(lambda emit, gone: st.service.run(turn, who, session_id, emit, gone))
    try:
        resolved = await pump.get()
        if not isinstance(resolved, Resolved):  # run() emits the session first or raises
            raise ApiError(500, "internal error (logged on the server)", code="internal_error")
        head = await pump.get()
        while isinstance(head, QueuedEvent):  # headers wait until the turn runs (or fails)
            head = await pump.get()
    except BaseException:
        pump.cancel()
        raise
    completion = Completion.new(resolved.model, resolved.session_id, resolved.new_session, resolved.policy)
    headers = {SESSION_HEADER: resolved.session_id}
    if turn.stream:
        headers["Cache-Control"] = "no-cache"
        events = stream(pump, head, completion, turn.include_usage)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    try:
        while not isinstance(head, TurnDone):
            if head is FINISHED:
                raise ApiError(503, "the turn ended without a result; send it again", code="unavailable")
            head = await pump.get()
    finally:
        pump.cancel()
    return JSONResponse(completion.body(head), headers=headers)


async def stream(
    pump: TurnPump, head: object, completion: Completion, include_usage: bool
) -> AsyncIterator[bytes]:
    """SSE: a role chunk, one chunk per text delta, the finishing chunk(s), ``[DONE]``. A failure
    after the headers went out is sent as an ``error`` event (the openai client raises it)."""
    sent, event = "", head
    try:
        yield sse(completion.chunk({"role": "assistant", "content": ""}))
        while True:
            if isinstance(event, TokenEvent) and event.text:
                sent += event.text
                yield sse(completion.chunk({"content": event.text}))
            elif isinstance(event, TurnDone):
                reply = event.result.reply
                if reply.startswith(sent) and len(reply) > len(sent):  # held-back or final text
                    yield sse(completion.chunk({"content": reply[len(sent) :]}))
                for chunk in completion.last_chunks(event, include_usage):
                    yield sse(chunk)
                yield DONE
                return
            elif event is FINISHED:
                raise ApiError(503, "the turn ended without a result; send it again", code="unavailable")
            event = await pump.get()
    except ApiError as err:
        yield sse(err.body())
    finally:
        pump.cancel()


@router.get("/v1/models")
async def list_models(request: Request, who: str = Depends(principal)) -> dict:
    models = state(request).service.served_models()
    return {"object": "list", "data": [_model(m) for m in models]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request, who: str = Depends(principal)) -> dict:
    if model_id not in state(request).service.served_models():
        raise ApiError(404, f"the model {model_id!r} does not exist here", "model", "model_not_found")
    return _model(model_id)


def _model(model_id: str) -> dict:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "confkv"}


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while the scheduler serves (its session store answers), else 503: the same rule as
    the gRPC health service. Open without credentials, for orchestrators."""
    st = state(request)
    scheduler = st.service.scheduler
    workers = scheduler.cluster.stats(0).workers
    detail = {"workers": len(workers), "workers_healthy": sum(w.healthy for w in workers)}
    if st.draining:
        return JSONResponse(ApiError(503, "shutting down", code="unavailable").body(), status_code=503)
    if not scheduler.store_ok:
        err = ApiError(
            503, "the session store is unreachable; turns fail until it is back", code="unavailable"
        )
        return JSONResponse({**err.body(), **detail}, status_code=503)
    return JSONResponse({"status": "ok", **detail})
