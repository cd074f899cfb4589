"""A thin client of the Scheduler service for load tests: create a session, stream a turn with
timing, end it. Transport only; works under threads and (after ``init_gevent``) greenlets.

Every create and turn carries a request id and is retried with it (up to ``retries`` times) when
its outcome is unknown (UNAVAILABLE, deadline): the scheduler answers a repeated id with what it
already did, so a retry never makes a second session or records a turn twice."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from loadtest.conversations import SYSTEM_PROMPT, Turn
from loadtest.metrics import TurnMetrics, TurnTimer

TOKEN_ENV = "CONFKV_TOKEN"
UNKNOWN_OUTCOME = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
T = TypeVar("T")


@dataclass(frozen=True)
class TurnReply:
    text: str
    metrics: TurnMetrics
    finish_reason: int
    session_bytes: int
    queued_s: float = 0.0  # time the turn waited for KV room (from GenerationDone)


def metadata() -> tuple[tuple[str, str], ...]:
    """Shared-secret token (if ``CONFKV_TOKEN`` is set) as call metadata."""
    token = os.environ.get(TOKEN_ENV)
    return (("authorization", f"Bearer {token}"),) if token else ()


def new_request_id() -> str:
    return secrets.token_hex(12)


class SchedulerClient:
    def __init__(self, target: str, timeout_s: float = 600.0, retries: int = 2):
        from confkv_proto import scheduler_pb2, scheduler_pb2_grpc, worker_pb2

        self.pb, self.wpb = scheduler_pb2, worker_pb2
        self.channel = grpc.insecure_channel(target)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.timeout_s, self.retries = timeout_s, retries
        self.in_flight: set = set()  # streaming Chat calls not finished yet
        self.retried = 0  # calls sent again after an unknown outcome

    def _with_retries(self, call: Callable[[], T]) -> T:
        """``call`` (which resends the same request id) until it succeeds, fails for certain, or
        ``retries`` resends were spent."""
        attempts = 0
        while True:
            try:
                return call()
            except grpc.RpcError as err:
                attempts += 1
                if attempts > self.retries or err.code() not in UNKNOWN_OUTCOME:
                    raise
                self.retried += 1

    def create_session(
        self, policy: str, model: str = "", system: str = SYSTEM_PROMPT, request_id: str = ""
    ) -> str:
        messages = [self.wpb.ChatMessage(role="system", content=system)] if system else []
        request = self.pb.CreateSessionRequest(
            policy=policy, model=model, messages=messages, request_id=request_id or new_request_id()
        )
        create = lambda: self.stub.CreateSession(request, timeout=self.timeout_s, metadata=metadata())
        return self._with_retries(create).session_id

    def chat(
        self, session_id: str, turn: Turn, max_new_tokens: int, seed: int = 0, request_id: str = ""
    ) -> TurnReply:
        """Stream one turn; raises grpc.RpcError on failure (the caller counts it). A retried turn
        whose first try was recorded is answered from the store (``replayed``), not run again."""
        request = self.pb.ChatRequest(
            session_id=session_id, content=turn.content, role=turn.role, max_new_tokens=max_new_tokens,
            temperature=0.0, seed=seed, request_id=request_id or new_request_id(),
        )  # fmt: skip
        return self._with_retries(lambda: self._stream(request))

    def _stream(self, request) -> TurnReply:
        timer = TurnTimer()
        text, reason, kv, queued_s = "", 0, 0, 0.0
        call = self.stub.Chat(request, timeout=self.timeout_s, metadata=metadata())
        self.in_flight.add(call)
        try:
            for event in call:
                kind = event.WhichOneof("event")
                if kind == "token":
                    timer.token()
                    kv = event.token.session_bytes
                elif kind == "queued":
                    timer.queued = True
                elif kind == "done":
                    text, reason, queued_s = event.done.text, event.done.reason, event.done.queued_seconds
                    kv = event.done.session.kv_bytes if event.done.HasField("session") else kv
        except BaseException:  # an error, or the load test stopping this user (GreenletExit)
            call.cancel()  # the server stops generating for a client that is gone
            raise
        finally:
            self.in_flight.discard(call)
        return TurnReply(text, timer.finish(), reason, kv, queued_s)

    def cancel_in_flight(self) -> int:
        """Cancel every turn still streaming; returns how many there were."""
        calls = list(self.in_flight)
        for call in calls:
            call.cancel()
        self.in_flight.clear()
        return len(calls)

    def end_session(self, session_id: str) -> None:
        self.stub.EndSession(
            self.pb.EndSessionRequest(session_id=session_id), timeout=30, metadata=metadata()
        )

    def cluster_stats(self):
        return self.stub.GetClusterStats(self.pb.ClusterStatsRequest(), timeout=30, metadata=metadata())

    def close(self) -> None:
        self.cancel_in_flight()
        self.channel.close()
