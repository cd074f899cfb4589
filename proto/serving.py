"""Server-side wire helpers both services use (hand-written, beside the generated code).

- ``new_server`` / ``bind``: a gRPC server that refuses a port another process holds (gRPC enables
  SO_REUSEPORT by default, which lets two servers silently split one port's traffic) and rejects
  invalid ports; ``BindError`` carries a one-line reason.
- ``Guard``: an interceptor that turns a request that cannot be decoded (invalid UTF-8 in a
  string field, garbage bytes) into INVALID_ARGUMENT, and an unexpected exception into INTERNAL
  with a generic text (the details go to the log, never to the caller).
- ``TokenAuth``: bearer tokens -> principal names, set per call for the servicer to read.
- ``is_loopback``: whether binding ``host`` keeps the service on this machine.
"""

from __future__ import annotations

import contextvars
import hmac
import ipaddress
import logging
from collections.abc import Mapping, Sequence
from concurrent import futures

import grpc

log = logging.getLogger("confkv.wire")
HEALTH_PREFIX = "/grpc.health.v1.Health/"
PRINCIPAL: contextvars.ContextVar[str] = contextvars.ContextVar("confkv_principal", default="anonymous")
MAX_MESSAGE_BYTES = 16 << 20  # a request larger than this is RESOURCE_EXHAUSTED before decoding


class BindError(ValueError):
    """The server could not bind its address (port in use, invalid port or host)."""


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost6"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def new_server(max_threads: int, interceptors: Sequence[grpc.ServerInterceptor] = ()) -> grpc.Server:
    options = [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_threads),
        interceptors=[Guard(), *interceptors],
        options=options,
    )


def bind(server: grpc.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> int:
    """Bind ``host:port`` (0 = any free port); ``BindError`` when the port is invalid or in use."""
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise BindError(f"invalid port {port!r}: use 0..65535 (0 = any free port)")
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        bound = (
            server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        )
    except RuntimeError as err:  # newer grpcio raises instead of returning 0
        raise BindError(f"cannot bind {address}: port in use or address unavailable ({err})") from None
    if bound == 0:
        raise BindError(f"cannot bind {address}: port in use or address unavailable")
    return bound


class Guard(grpc.ServerInterceptor):
    """Decode requests inside the handler, so a malformed one is the caller's INVALID_ARGUMENT
    (gRPC would answer INTERNAL), and hide unexpected exceptions behind a generic INTERNAL."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        decode = handler.request_deserializer
        if handler.response_streaming:
            inner = handler.unary_stream

            def stream(raw, context):
                request = _decode(decode, raw, context, method)
                try:
                    yield from inner(request, context)
                except Exception as err:
                    _internal(context, method, err)

            return grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=None, response_serializer=handler.response_serializer
            )
        unary = handler.unary_unary

        def call(raw, context):
            request = _decode(decode, raw, context, method)
            try:
                return unary(request, context)
            except Exception as err:
                _internal(context, method, err)

        return grpc.unary_unary_rpc_method_handler(
            call, request_deserializer=None, response_serializer=handler.response_serializer
        )


def _decode(decode, raw: bytes, context, method: str):
    if decode is None:
        return raw
    try:
        return decode(raw)
    except Exception as err:
        log.info("undecodable request to %s: %s", method, err)
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, "the request could not be decoded (invalid protobuf or UTF-8)"
        )


def _internal(context, method: str, err: Exception):
    if _is_abort(err, context):
        raise err
    log.exception("unexpected error in %s", method)
    context.abort(
        grpc.StatusCode.INTERNAL, f"internal error in {method.rsplit('/', 1)[-1]} (logged on the server)"
    )


def _is_abort(err: Exception, context) -> bool:
    """context.abort raises a bare Exception after setting the code: let it through."""
    code = getattr(context, "code", lambda: None)()
    return code is not None and code != grpc.StatusCode.OK


class TokenAuth(grpc.ServerInterceptor):
    """``authorization: Bearer <token>`` -> principal name (``tokens`` maps token -> principal).
    Wrong or missing token: UNAUTHENTICATED. Health checks stay open for orchestrators. With no
    tokens every caller is the principal ``anonymous``."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        if any(not t for t in tokens):
            raise ValueError("an auth token must not be empty")
        self._tokens = {f"Bearer {t}".encode(): name for t, name in tokens.items()}

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token (authorization metadata)")

        def deny_stream(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token (authorization metadata)")
            yield  # pragma: no cover

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny_stream)

    def principal(self, metadata) -> str | None:
        given = dict(metadata or ()).get("authorization", "").encode()
        found = None
        for expected, name in self._tokens.items():  # compare with every token: constant time
            if hmac.compare_digest(given, expected):
                found = name
        return found

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler_call_details.method.startswith(HEALTH_PREFIX) or handler is None:
            return handler
        name = self.principal(handler_call_details.invocation_metadata)
        if name is None:
            return self._deny_stream if handler.response_streaming else self._deny_unary
        return _with_principal(handler, name)


def _with_principal(handler, name: str):
    if handler.response_streaming and not handler.request_streaming:
        inner_stream = handler.unary_stream

        def stream(request, context):
            token = PRINCIPAL.set(name)
            try:
                yield from inner_stream(request, context)
            finally:
                PRINCIPAL.reset(token)

        return handler._replace(unary_stream=stream)
    if not handler.response_streaming and not handler.request_streaming:
        inner = handler.unary_unary

        def call(request, context):
            token = PRINCIPAL.set(name)
            try:
                return inner(request, context)
            finally:
                PRINCIPAL.reset(token)

        return handler._replace(unary_unary=call)
    return handler


def current_principal() -> str:
    return PRINCIPAL.get()
