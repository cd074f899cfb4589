"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status
the OpenAI API uses for the same failure (the ``openai`` client picks its exception class by
status: 400 BadRequest, 401 Authentication, 404 NotFound, 409 Conflict, 413, 429 RateLimit,
5xx InternalServer)."""

from __future__ import annotations

from scheduler_svc.errors import (
    Cancelled,
    Conflict,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SchedulerError,
    Unavailable,
    WorkerRefused,
)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """An error response. ``param`` names the offending request field (or None). Not a frozen
    dataclass: frameworks set ``__traceback__`` on exceptions they handle."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        if status not in _TYPES:
            raise ValueError(f"no OpenAI error type for HTTP status {status}")
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def __str__(self) -> str:
        return self.message

    @property
    def type(self) -> str:
        return _TYPES[self.status]

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _is_context_limit(message: str) -> bool:
    # The worker refuses a conversation longer than its context with RESOURCE_EXHAUSTED; unlike a
    # full pool, retrying cannot help: OpenAI answers that with 400 context_length_exceeded.
    lowered = message.lower()
    return "context" in lowered and ("limit" in lowered or "can hold" in lowered)


def from_scheduler(err: SchedulerError, started: bool = True) -> ApiError:
    """Map a scheduler domain error. ``started``: raised while the turn ran (admission queue,
    workers) rather than while the request was validated; decides 429 vs 400 for a refusal."""
    text = str(err)
    if isinstance(err, InvalidArgument):
        return ApiError(400, text, code="invalid_value")
    if isinstance(err, NotFound):
        return ApiError(404, text, code="not_found")
    if isinstance(err, Conflict):
        return ApiError(409, text, code="conflict")
    if isinstance(err, ResourceExhausted | WorkerRefused):
        if _is_context_limit(text) or not started:
            return ApiError(400, text, param="messages", code="context_length_exceeded")
        return ApiError(429, text, code="rate_limit_exceeded")
    if isinstance(err, Unavailable):
        return ApiError(503, text, code="unavailable")
    if isinstance(err, Cancelled):
        return ApiError(499, text, code="cancelled")
    return ApiError(500, "internal error (logged on the server)", code="internal_error")
