"""A small Scheduler client (used by ``confkv chat``, ``confkv serve --demo``, the benchmark and
tests). Returns proto messages; raises ``grpc.RpcError`` with the server's status."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import grpc
from confkv_proto import scheduler_pb2 as pb
from confkv_proto import scheduler_pb2_grpc as pb_grpc
from confkv_proto import worker_pb2

from scheduler_svc.security import auth_metadata, channel

# the call may or may not have been applied: retry it with its request id
UNKNOWN_OUTCOME = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class SchedulerClient:
    def __init__(self, address: str, token: str | None = None, ca_file: str | None = None) -> None:
        self.address = address
        self.channel = channel(address, ca_file)
        self.stub = pb_grpc.SchedulerStub(self.channel)
        self.metadata = auth_metadata(token)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout_s)

    def create_session(
        self,
        policy: str = "",
        model: str = "",
        system: str = "",
        request_id: str | None = None,
        retries: int = 2,
    ) -> pb.Session:
        """A new session. Sent with a request id (default: a fresh random one) and retried with it
        up to ``retries`` times when the outcome is unknown (UNAVAILABLE, deadline): a reply lost on
        the way back still makes exactly one session."""
        messages = [worker_pb2.ChatMessage(role="system", content=system)] if system else []
        request = pb.CreateSessionRequest(
            policy=policy, model=model, messages=messages, request_id=request_id or secrets.token_hex(12)
        )
        attempts = 0
        while True:
            try:
                return self.stub.CreateSession(request, metadata=self.metadata, timeout=30)
            except grpc.RpcError as err:
                attempts += 1
                if attempts > retries or err.code() not in UNKNOWN_OUTCOME:
                    raise

    def chat(
        self,
        session_id: str,
        content: str,
        max_new_tokens: int = 0,
        temperature: float = 0.0,
        timeout: float = 600,
        request_id: str | None = None,
        top_p: float = 1.0,
    ) -> Iterator[pb.ChatEvent]:
        """One turn's events. ``request_id`` (default: a fresh random one) makes a retry
        exactly-once: send the same id again when the outcome is unknown."""
        request = pb.ChatRequest(
            session_id=session_id,
            content=content,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            request_id=request_id or secrets.token_hex(12),
        )
        return self.stub.Chat(request, metadata=self.metadata, timeout=timeout)

    def turn(self, session_id: str, content: str, max_new_tokens: int = 0) -> tuple[str, pb.ChatEvent]:
        """Run one turn to the end: (streamed text, the final done event)."""
        text, last = [], None
        for event in self.chat(session_id, content, max_new_tokens):
            if event.HasField("token"):
                text.append(event.token.text)
            elif event.HasField("done"):
                last = event
        if last is None:
            raise RuntimeError("the turn ended without a done event")
        return "".join(text), last

    def get_session(self, session_id: str, transcript: bool = True) -> pb.Session:
        request = pb.GetSessionRequest(session_id=session_id, include_transcript=transcript)
        return self.stub.GetSession(request, metadata=self.metadata, timeout=30)

    def list_sessions(self, page_size: int = 100, page_token: str = "") -> pb.ListSessionsReply:
        request = pb.ListSessionsRequest(page_size=page_size, page_token=page_token)
        return self.stub.ListSessions(request, metadata=self.metadata, timeout=30)

    def end_session(self, session_id: str) -> pb.EndSessionReply:
        return self.stub.EndSession(
            pb.EndSessionRequest(session_id=session_id), metadata=self.metadata, timeout=30
        )

    def stats(self) -> pb.ClusterStats:
        return self.stub.GetClusterStats(pb.ClusterStatsRequest(), metadata=self.metadata, timeout=30)

    def close(self) -> None:
        self.channel.close()
