"""The FastAPI application over a running ``Scheduler``: the same core, sessions, store and
client principals as the gRPC servicer; this layer only translates HTTP <-> domain."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from confkv_proto.serving import MAX_MESSAGE_BYTES, TokenAuth
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from scheduler_svc.core import Scheduler
from scheduler_svc.http.errors import ApiError
from scheduler_svc.http.routes import HttpState, router
from scheduler_svc.http.schemas import validation_error
from scheduler_svc.http.service import ChatService
from scheduler_svc.http.session_index import PrefixIndex, index_for

log = logging.getLogger("confkv.http")


def _authenticator(client_tokens: Mapping[str, str] | None):
    """Authorization header -> principal, or None; exactly the gRPC servicer's token check."""
    if not client_tokens:
        return None
    auth = TokenAuth(client_tokens)
    return lambda header: auth.principal((("authorization", header),))


def create_app(
    scheduler: Scheduler,
    client_tokens: Mapping[str, str] | None = None,
    index: PrefixIndex | None = None,
    max_body_bytes: int = MAX_MESSAGE_BYTES,
) -> FastAPI:
    """``client_tokens``: bearer token -> principal (None/empty = no auth: every caller is
    ``anonymous``); ``index``: the prefix index (default: in Redis when the store is Redis)."""
    app = FastAPI(title="Conf-KV", docs_url=None, redoc_url=None, openapi_url=None)
    service = ChatService(scheduler, index if index is not None else index_for(scheduler.store))
    app.state.confkv = HttpState(service, _authenticator(client_tokens), max_body_bytes)
    app.include_router(router)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        if err.status >= 500:
            log.warning("%s %s: %s", request.method, request.url.path, err)
        headers = {"Retry-After": "1"} if err.status in (429, 503) else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        api = validation_error(list(err.errors()))
        return JSONResponse(api.body(), status_code=api.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        status = err.status_code if err.status_code in (401, 404, 413, 429, 503) else 400
        if err.status_code == 405:
            status = 404  # as OpenAI: a method the path does not have is an unknown route
        api = ApiError(status, f"{request.method} {request.url.path}: {err.detail}", code="unknown_url")
        return JSONResponse(api.body(), status_code=status)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception) -> JSONResponse:
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        api = ApiError(500, "internal error (logged on the server)", code="internal_error")
        return JSONResponse(api.body(), status_code=500)

    return app
