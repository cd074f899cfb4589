"""Session store: the interface and an in-memory implementation (Redis: ``store_redis.py``).

The store is the source of truth for transcripts (a worker's copy is only a cache). Every
acknowledged turn is written atomically (one Lua script: check the request id and the turn
number, append the user message and the reply, remember the request id with the reply, update
metadata) before the scheduler acknowledges it. A retry with the same request id finds the turn
already recorded instead of recording it twice, so a client may always retry a turn whose
outcome it does not know. Any Redis error raises ``StoreUnavailable`` saying only what is known:
a failed read recorded nothing; a failed write may or may not have been applied. redis-py
reconnects by itself, so service recovers as soon as Redis is back.

Creating a session is idempotent too: a ``CreateSession`` request id, scoped to the caller
(principal), names the session it created for ``request_ttl_s`` (the retention, or a day when
sessions are kept forever); a retry with it gets that session instead of a second one.

Retention: every key of a session expires ``retention_s`` after its last write (None = never).
"""

from __future__ import annotations

import builtins
import copy
import dataclasses
import json
import secrets
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from scheduler_svc.domain import Message, SessionRecord
from scheduler_svc.errors import Conflict, NotFound

DEFAULT_RETENTION_S = 7 * 24 * 3600.0  # a session nobody writes to for a week is deleted
CREATE_REQUEST_TTL_S = 24 * 3600.0  # how long a create's request id is kept without a retention


def request_ttl_s(retention_s: float | None) -> float:
    """How long a ``CreateSession`` request id answers retries: the retention, or one day."""
    return retention_s or CREATE_REQUEST_TTL_S


def ended(session_id: str, request_id: str) -> NotFound:
    return NotFound(f"request id {request_id!r} created session {session_id!r}, which has since ended")


def new_session_id() -> str:
    """128 random bits, URL-safe: unguessable, and scoped to its owner anyway. Never begins with
    '-' (one id in 64 would), so ``confkv sessions show ID`` reads it as an id, not an option."""
    while (session_id := secrets.token_urlsafe(16)).startswith("-"):
        pass
    return session_id


@dataclass(frozen=True)
class RecordedTurn:
    """What the store remembers of a turn under its request id (to answer a retry)."""

    turn: int
    reply: str
    worker: str
    footprint: int
    replayed: bool = False  # returned for a request id that was already recorded

    def to_json(self) -> str:
        return json.dumps(
            {"turn": self.turn, "reply": self.reply, "worker": self.worker, "footprint": self.footprint}
        )

    @classmethod
    def from_json(cls, text: str) -> RecordedTurn:
        data = json.loads(text)
        return cls(int(data["turn"]), str(data["reply"]), str(data["worker"]), int(data["footprint"]))


class SessionStore(ABC):
    @abstractmethod
    def create(self, record: SessionRecord, request_id: str = "") -> SessionRecord:
        """Store a new session and return it; atomically, unless ``request_id`` already created a
        session for ``record.owner``: then that session is returned and nothing is stored
        (NotFound if it has ended since)."""

    @abstractmethod
    def get(self, session_id: str) -> SessionRecord:
        """The full record with its transcript; NotFound if absent."""

    @abstractmethod
    def list(self, owner: str, limit: int = 100, offset: int = 0) -> list[SessionRecord]:
        """``owner``'s sessions, newest first, without transcripts."""

    @abstractmethod
    def count(self) -> int: ...

    @abstractmethod
    def append_turn(
        self,
        session_id: str,
        expected_turns: int,
        messages: builtins.list[Message],
        worker: str,
        footprint: int,
        now: float,
        request_id: str = "",
    ) -> RecordedTurn:
        """Atomically append one turn if the session still has ``expected_turns``; returns the
        recorded turn. If ``request_id`` was already recorded, returns that turn and appends
        nothing. NotFound if the session is gone, Conflict if another turn landed first."""

    @abstractmethod
    def recorded(self, session_id: str, request_id: str) -> RecordedTurn | None:
        """The turn recorded under ``request_id`` in this session, if any."""

    @abstractmethod
    def set_placement(self, session_id: str, worker: str, footprint: int) -> None:
        """Record where the session's KV lives ('' = nowhere). A deleted session stays deleted."""

    @abstractmethod
    def delete(self, session_id: str) -> bool: ...

    def ping(self) -> None:
        """Raise StoreUnavailable if the store cannot be reached."""
        return None

    def close(self) -> None:
        """Release connections."""
        return None


class MemoryStore(SessionStore):
    """In-process store for ``confkv serve`` without Redis and for tests."""

    def __init__(self, retention_s: float | None = DEFAULT_RETENTION_S, clock=time.time) -> None:
        self._records: dict[str, SessionRecord] = {}
        self._requests: dict[str, dict[str, RecordedTurn]] = {}
        self._created: dict[tuple[str, str], tuple[str, float]] = {}  # (owner, request id) -> id, expiry
        self._touched: dict[str, float] = {}
        self._lock = threading.Lock()
        self.retention_s, self.clock = retention_s, clock

    def _expire(self) -> None:  # lock held
        if self.retention_s is None:
            return
        now = self.clock()
        for session_id in [s for s, t in self._touched.items() if t < now - self.retention_s]:
            self._forget(session_id)
        for key in [k for k, (_, expiry) in self._created.items() if expiry <= now]:
            del self._created[key]

    def _forget(self, session_id: str) -> bool:
        self._touched.pop(session_id, None)
        self._requests.pop(session_id, None)
        return self._records.pop(session_id, None) is not None

    def create(self, record: SessionRecord, request_id: str = "") -> SessionRecord:
        with self._lock:
            self._expire()
            key = (record.owner, request_id)
            if request_id and key in self._created:
                session_id = self._created[key][0]
                if session_id not in self._records:
                    raise ended(session_id, request_id)
                return copy.deepcopy(self._records[session_id])
            self._records[record.session_id] = copy.deepcopy(record)
            self._touched[record.session_id] = now = self.clock()
            if request_id:
                self._created[key] = (record.session_id, now + request_ttl_s(self.retention_s))
            return copy.deepcopy(record)

    def _get(self, session_id: str) -> SessionRecord:
        self._expire()
        try:
            return self._records[session_id]
        except KeyError:
            raise NotFound(f"unknown session {session_id!r}") from None

    def get(self, session_id: str) -> SessionRecord:
        with self._lock:
            return copy.deepcopy(self._get(session_id))

    def list(self, owner: str, limit: int = 100, offset: int = 0) -> list[SessionRecord]:
        with self._lock:
            self._expire()
            mine = [r for r in self._records.values() if r.owner == owner]
            records = sorted(mine, key=lambda r: r.created_at, reverse=True)
            return [dataclasses.replace(r, transcript=[]) for r in records[offset : offset + limit]]

    def count(self) -> int:
        with self._lock:
            self._expire()
            return len(self._records)

    def append_turn(
        self, session_id, expected_turns, messages, worker, footprint, now, request_id=""
    ) -> RecordedTurn:
        with self._lock:
            record = self._get(session_id)
            seen = self._requests.setdefault(session_id, {})
            if request_id and request_id in seen:
                return dataclasses.replace(seen[request_id], replayed=True)
            if record.turns != expected_turns:
                raise Conflict(f"session {session_id!r} has {record.turns} turns, expected {expected_turns}")
            record.transcript.extend(messages)
            record.turns += 1
            record.worker, record.footprint_bytes, record.updated_at = worker, footprint, now
            self._touched[session_id] = self.clock()
            done = RecordedTurn(record.turns, messages[-1].content if messages else "", worker, footprint)
            if request_id:
                seen[request_id] = done
            return done

    def recorded(self, session_id: str, request_id: str) -> RecordedTurn | None:
        with self._lock:
            self._get(session_id)
            return self._requests.get(session_id, {}).get(request_id)

    def set_placement(self, session_id: str, worker: str, footprint: int) -> None:
        with self._lock:
            record = self._records.get(session_id)
            if record is not None:
                record.worker, record.footprint_bytes = worker, footprint

    def delete(self, session_id: str) -> bool:
        with self._lock:
            return self._forget(session_id)
