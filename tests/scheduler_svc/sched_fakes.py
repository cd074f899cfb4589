"""In-process fake workers for the scheduler's transport-free tests.

A fake holds sessions like a worker: transcript, policy, KV bytes that grow with the context up
to the policy's bound, a pool it refuses to exceed, and a ``dead`` switch."""

from __future__ import annotations

import threading

from confkv.memory import KVGeometry
from confkv.policies import parse_policy
from scheduler_svc.domain import Message, TokenEvent, TurnResult, WorkerReport
from scheduler_svc.errors import NotFound, WorkerRefused, WorkerUnavailable
from scheduler_svc.placement import reservation_bytes

GEOMETRY = KVGeometry(n_layers=2, n_kv_heads=2, head_dim=8, dtype_bytes=4)  # 128 B per token (FP)
MAX_CONTEXT = 256


def reply_for(transcript: list[Message]) -> str:
    """Deterministic reply: depends on the whole transcript, so a replay is checkable."""
    last = transcript[-1].content
    return f"echo{len(transcript)} " + " ".join(reversed(last.split()))


class FakeWorker:
    def __init__(self, address: str, capacity_bytes: int, model: str = "tiny") -> None:
        self.address, self.capacity, self.model = address, capacity_bytes, model
        self.sessions: dict[str, dict] = {}
        self.dead = False
        self.opens = 0
        self.gate: threading.Event | None = None  # when set, turns wait on it after the first token
        self._lock = threading.Lock()

    def _alive(self) -> None:
        if self.dead:
            raise WorkerUnavailable(f"{self.address} is down")

    def used(self) -> int:
        return sum(s["bytes"] for s in self.sessions.values())

    def report(self) -> WorkerReport:
        self._alive()
        with self._lock:
            per = {sid: s["bytes"] for sid, s in self.sessions.items()}
        return WorkerReport(
            self.address, self.model, GEOMETRY, MAX_CONTEXT, self.capacity, sum(per.values()), per
        )

    def open(self, session_id: str, policy: str, transcript: list[Message]) -> None:
        self._alive()
        need = reservation_bytes(parse_policy(policy), GEOMETRY, MAX_CONTEXT)
        with self._lock:
            reserved = sum(s["need"] for s in self.sessions.values())
            if reserved + need > self.capacity:
                raise WorkerRefused(f"{self.address}: pool full")
            self.opens += 1
            self.sessions[session_id] = {
                "transcript": list(transcript),
                "need": need,
                "bytes": 0,
                "tokens": 0,
            }
            self._grow(session_id, sum(len(m.content.split()) + 4 for m in transcript))

    def _grow(self, session_id: str, tokens: int) -> None:
        session = self.sessions[session_id]
        session["tokens"] += tokens
        session["bytes"] = min(session["need"], GEOMETRY.full_bytes(session["tokens"]))
        assert self.used() <= self.capacity, "fake worker pool exceeded"

    def turn(self, session_id, message, max_new_tokens, temperature=0.0, seed=0):
        self._alive()
        if session_id not in self.sessions:
            raise NotFound(f"{self.address} does not hold {session_id}")
        session = self.sessions[session_id]
        reply = reply_for([*session["transcript"], message])
        words = reply.split()[:max_new_tokens]
        with self._lock:
            self._grow(session_id, len(message.content.split()) + 4)
        for index, word in enumerate(words):
            if index == 1 and self.gate is not None:
                self.gate.wait(10)
            self._alive()
            with self._lock:
                self._grow(session_id, 1)
            yield TokenEvent((" " if index else "") + word, index=index, session_bytes=session["bytes"])
        text = " ".join(words)
        session["transcript"] += [message, Message("assistant", text)]
        reason = "eos" if len(words) == len(reply.split()) else "max_tokens"
        yield TurnResult(text, reason, generated_tokens=len(words), kv_bytes=session["bytes"])

    def drop(self, session_id: str) -> None:
        self._alive()
        with self._lock:
            self.sessions.pop(session_id, None)

    def close(self) -> None:
        pass
