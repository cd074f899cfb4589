"""Serve the HTTP front door with uvicorn on a thread beside the gRPC server (``--http-port``).

The socket is bound here first, so a port in use or invalid is a ``BindError`` with one line
before anything runs, exactly like the gRPC ports.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import uvicorn
from confkv_proto.serving import MAX_MESSAGE_BYTES, BindError
from fastapi import FastAPI

from scheduler_svc.core import Scheduler
from scheduler_svc.http.app import create_app
from scheduler_svc.http.session_index import PrefixIndex


@dataclass
class HttpServer:
    server: uvicorn.Server
    app: FastAPI
    thread: threading.Thread
    host: str
    port: int
    scheme: str = "http"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def stop(self, grace: float = 5.0) -> None:
        """Refuse new calls (health turns 503), let streams in flight finish for ``grace`` s."""
        self.app.state.confkv.draining = True
        self.server.should_exit = True
        self.thread.join(grace + 5.0)


def bind_socket(host: str, port: int) -> socket.socket:
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise BindError(f"invalid port {port!r}: use 0..65535 (0 = any free port)")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
        sock.listen(128)
    except OSError as err:
        sock.close()
        raise BindError(f"cannot bind {host}:{port}: {err.strerror or err}") from None
    return sock


def start_http_server(
    scheduler: Scheduler,
    host: str = "127.0.0.1",
    port: int = 0,
    client_tokens: Mapping[str, str] | None = None,
    tls: tuple[str, str] | None = None,
    grace: float = 5.0,
    index: PrefixIndex | None = None,
    max_body_bytes: int = MAX_MESSAGE_BYTES,
) -> HttpServer:
    """Serve the OpenAI-compatible API for ``scheduler`` (already started) on ``host:port``.
    ``tls`` is (cert_file, key_file), as for the gRPC server."""
    app = create_app(scheduler, client_tokens, index, max_body_bytes)
    sock = bind_socket(host, port)
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=max(math.ceil(grace), 1),
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="http-front", daemon=True)
    thread.start()
    deadline = time.monotonic() + 15.0
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError("the HTTP server did not start (see the log)")
        time.sleep(0.01)
    bound = sock.getsockname()[1]
    return HttpServer(server, app, thread, host, bound, "https" if tls else "http")
