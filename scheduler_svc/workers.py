"""The scheduler's view of a worker: a small interface that a gRPC client implements for real
workers and tests implement in-process with fakes.

Errors a client raises (scheduler_svc.errors): ``WorkerUnavailable`` (no answer: dead or
unreachable), ``TurnFailed`` (the worker failed that one turn but is healthy), ``WorkerRefused``
(its KV pool is full), ``NotFound`` (it does not hold the session, e.g. it restarted),
``InvalidArgument`` (it rejected the input).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Protocol

from scheduler_svc.domain import Message, Sampling, TokenEvent, TurnResult, WorkerReport


class WorkerClient(Protocol):
    address: str

    def report(self) -> WorkerReport:
        """Current footprint: capacity, bytes in use, bytes per session, model geometry."""
        ...

    def open(self, session_id: str, policy: str, transcript: list[Message]) -> None:
        """Create the session's cache on the worker from a transcript (replayed into the cache)."""
        ...

    def turn(
        self, session_id: str, message: Message, sampling: Sampling, request_id: str = ""
    ) -> Generator[TokenEvent | TurnResult, None, None]:
        """Append ``message`` and generate: token pieces as produced, then one TurnResult.
        Closing the iterator early cancels generation."""
        ...

    def cancel_calls(self) -> None:
        """End every call in flight to this worker now (it was marked down: a stopped process
        would otherwise hold its streams open forever)."""
        ...

    def drop(self, session_id: str) -> None:
        """Free the session's cache (unknown sessions are ignored)."""
        ...

    def close(self) -> None: ...
