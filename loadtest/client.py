"""A thin client of the Scheduler service for load tests: create a session, stream a turn with
timing, end it. Transport only; works under threads and (after ``init_gevent``) greenlets."""

from __future__ import annotations

import os
from dataclasses import dataclass

import grpc

from loadtest.conversations import SYSTEM_PROMPT, Turn
from loadtest.metrics import TurnMetrics, TurnTimer

TOKEN_ENV = "CONFKV_TOKEN"


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


class SchedulerClient:
    def __init__(self, target: str, timeout_s: float = 600.0):
        from confkv_proto import scheduler_pb2, scheduler_pb2_grpc, worker_pb2

        self.pb, self.wpb = scheduler_pb2, worker_pb2
        self.channel = grpc.insecure_channel(target)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.timeout_s = timeout_s
        self.in_flight: set = set()  # streaming Chat calls not finished yet

    def create_session(self, policy: str, model: str = "", system: str = SYSTEM_PROMPT) -> str:
        messages = [self.wpb.ChatMessage(role="system", content=system)] if system else []
        request = self.pb.CreateSessionRequest(policy=policy, model=model, messages=messages)
        return self.stub.CreateSession(request, timeout=self.timeout_s, metadata=metadata()).session_id

    def chat(self, session_id: str, turn: Turn, max_new_tokens: int, seed: int = 0) -> TurnReply:
        """Stream one turn; raises grpc.RpcError on failure (the caller counts it)."""
        request = self.pb.ChatRequest(
            session_id=session_id, content=turn.content, role=turn.role,
            max_new_tokens=max_new_tokens, temperature=0.0, seed=seed,
        )  # fmt: skip
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
