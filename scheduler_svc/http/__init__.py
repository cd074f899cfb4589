"""OpenAI-compatible HTTP front door of the scheduler (``--http-port``): ``/v1/chat/completions``
(SSE streaming and not), ``/v1/models``, ``/health``, over the same ``Scheduler`` core, sessions,
store and client principals as the gRPC API. FastAPI + uvicorn; this package translates only.

Layout: ``schemas`` (requests, translation), ``service`` (session choice, the turn),
``session_index`` (prefix hash -> session), ``responses`` (bodies, chunks, usage), ``pump``
(blocking turn -> event loop), ``routes``, ``errors`` (OpenAI error shape), ``app``, ``server``.
"""

from scheduler_svc.http.app import create_app
from scheduler_svc.http.server import HttpServer, start_http_server

__all__ = ["HttpServer", "create_app", "start_http_server"]
