"""Shared-secret token (``authorization: Bearer <token>`` metadata) and TLS helpers, for the
scheduler's own server and for its calls to workers."""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


class TokenInterceptor(grpc.ServerInterceptor):
    """Rejects calls without the shared token with UNAUTHENTICATED (health checks stay open so
    orchestrators can probe without the secret)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the shared token must not be empty")
        self._expected = f"Bearer {token}".encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token (authorization metadata)")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(HEALTH_PREFIX):
            return continuation(handler_call_details)
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(given.encode(), self._expected):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(Path(key_file).read_bytes(), Path(cert_file).read_bytes())])


def channel(address: str, ca_file: str | None = None) -> grpc.Channel:
    """A channel to ``address``: TLS when a CA certificate file is given, else plaintext."""
    options = [("grpc.max_receive_message_length", 64 << 20)]
    if ca_file:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(ca_file).read_bytes())
        return grpc.secure_channel(address, creds, options=options)
    return grpc.insecure_channel(address, options=options)
