"""Credentials: client tokens (``authorization: Bearer <token>``, one principal each) for the
scheduler's own server, the separate worker token for its calls to workers, and TLS helpers.
The server-side interceptor is ``confkv_proto.serving.TokenAuth``."""

from __future__ import annotations

from pathlib import Path

import grpc


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def client_tokens(text: str | None) -> dict[str, str]:
    """Client credentials from a comma-separated list: ``name=token`` (principal ``name``) or a
    bare ``token`` (principal ``client-<hash prefix>``). Returns token -> principal."""
    import hashlib

    tokens: dict[str, str] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, token = item.partition("=")
        if not sep:
            name, token = f"client-{hashlib.sha256(item.encode()).hexdigest()[:8]}", item
        if not name or not token:
            raise ValueError("client tokens are name=token or token, comma-separated")
        if token in tokens:
            raise ValueError("the same client token is listed twice")
        tokens[token] = name
    return tokens


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(Path(key_file).read_bytes(), Path(cert_file).read_bytes())])


def channel(address: str, ca_file: str | None = None) -> grpc.Channel:
    """A channel to ``address``: TLS when a CA certificate file is given, else plaintext."""
    options = [("grpc.max_receive_message_length", 64 << 20)]
    if ca_file:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(ca_file).read_bytes())
        return grpc.secure_channel(address, creds, options=options)
    return grpc.insecure_channel(address, options=options)
