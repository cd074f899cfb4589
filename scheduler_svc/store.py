"""Session store: an interface, an in-memory implementation and a Redis one (redis-py).

Every acknowledged turn is written atomically (one Lua script: check the turn number, append
the user message and the reply, update metadata) before the scheduler acknowledges it. Redis
being unreachable raises ``StoreUnavailable``; redis-py reconnects by itself on the next call,
so service recovers as soon as Redis is back.
"""

from __future__ import annotations

import builtins
import copy
import dataclasses
import functools
import json
import secrets
import threading
from abc import ABC, abstractmethod

from scheduler_svc.domain import Message, SessionRecord
from scheduler_svc.errors import Conflict, NotFound, StoreUnavailable


def new_session_id() -> str:
    """128 random bits, URL-safe: unguessable, so an id is enough to address a session."""
    return secrets.token_urlsafe(16)


class SessionStore(ABC):
    @abstractmethod
    def create(self, record: SessionRecord) -> None: ...

    @abstractmethod
    def get(self, session_id: str) -> SessionRecord:
        """The full record with its transcript; NotFound if absent."""

    @abstractmethod
    def list(self, limit: int = 100, offset: int = 0) -> list[SessionRecord]:
        """Newest first, without transcripts."""

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
    ) -> int:
        """Atomically append one turn if the session still has ``expected_turns``; returns the
        new turn count. NotFound if the session is gone, Conflict if another turn landed first."""

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

    def __init__(self) -> None:
        self._records: dict[str, SessionRecord] = {}
        self._lock = threading.Lock()

    def create(self, record: SessionRecord) -> None:
        with self._lock:
            self._records[record.session_id] = copy.deepcopy(record)

    def _get(self, session_id: str) -> SessionRecord:
        try:
            return self._records[session_id]
        except KeyError:
            raise NotFound(f"unknown session {session_id!r}") from None

    def get(self, session_id: str) -> SessionRecord:
        with self._lock:
            return copy.deepcopy(self._get(session_id))

    def list(self, limit: int = 100, offset: int = 0) -> list[SessionRecord]:
        with self._lock:
            records = sorted(self._records.values(), key=lambda r: r.created_at, reverse=True)
            return [dataclasses.replace(r, transcript=[]) for r in records[offset : offset + limit]]

    def count(self) -> int:
        with self._lock:
            return len(self._records)

    def append_turn(self, session_id, expected_turns, messages, worker, footprint, now) -> int:
        with self._lock:
            record = self._get(session_id)
            if record.turns != expected_turns:
                raise Conflict(f"session {session_id!r} has {record.turns} turns, expected {expected_turns}")
            record.transcript.extend(messages)
            record.turns += 1
            record.worker, record.footprint_bytes, record.updated_at = worker, footprint, now
            return record.turns

    def set_placement(self, session_id: str, worker: str, footprint: int) -> None:
        with self._lock:
            record = self._records.get(session_id)
            if record is not None:
                record.worker, record.footprint_bytes = worker, footprint

    def delete(self, session_id: str) -> bool:
        with self._lock:
            return self._records.pop(session_id, None) is not None


_APPEND_TURN = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local turns = tonumber(redis.call('HGET', KEYS[1], 'turns'))
if turns ~= tonumber(ARGV[1]) then return -2 end
for i = 5, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
redis.call('HSET', KEYS[1], 'turns', turns + 1, 'updated', ARGV[2], 'worker', ARGV[3], 'footprint', ARGV[4])
return turns + 1
"""

_SET_PLACEMENT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'worker', ARGV[1], 'footprint', ARGV[2])
return 1
"""


def _unavailable_on_connection_error(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        import redis

        try:
            return method(self, *args, **kwargs)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as err:
            raise StoreUnavailable(
                f"session store unreachable (Redis at {self.url}): {err}; nothing was recorded, retry later"
            ) from None

    return wrapper


class RedisStore(SessionStore):
    """Keys: ``{prefix}s:{id}`` hash of metadata, ``{prefix}t:{id}`` list of JSON messages,
    ``{prefix}index`` sorted set of ids by creation time."""

    def __init__(self, url: str, prefix: str = "confkv:", timeout_s: float = 2.0) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        if not prefix:
            raise ValueError("the Redis key prefix must not be empty")
        self.url, self.prefix = url, prefix
        self.client = redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        self._append = self.client.register_script(_APPEND_TURN)
        self._place = self.client.register_script(_SET_PLACEMENT)

    def _keys(self, session_id: str) -> tuple[str, str]:
        return f"{self.prefix}s:{session_id}", f"{self.prefix}t:{session_id}"

    @property
    def _index(self) -> str:
        return f"{self.prefix}index"

    @_unavailable_on_connection_error
    def ping(self) -> None:
        self.client.ping()

    @_unavailable_on_connection_error
    def create(self, record: SessionRecord) -> None:
        meta, transcript = self._keys(record.session_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(meta, mapping=_meta_fields(record))
        if record.transcript:
            pipe.rpush(transcript, *(json.dumps(m.to_dict()) for m in record.transcript))
        pipe.zadd(self._index, {record.session_id: record.created_at})
        pipe.execute()

    @_unavailable_on_connection_error
    def get(self, session_id: str) -> SessionRecord:
        meta, transcript = self._keys(session_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.hgetall(meta)
        pipe.lrange(transcript, 0, -1)
        fields, messages = pipe.execute()
        if not fields:
            raise NotFound(f"unknown session {session_id!r}")
        record = _record(session_id, fields)
        record.transcript = [Message.from_dict(json.loads(m)) for m in messages]
        return record

    @_unavailable_on_connection_error
    def list(self, limit: int = 100, offset: int = 0) -> list[SessionRecord]:
        ids: list[str] = self.client.zrevrange(self._index, offset, offset + max(limit, 1) - 1)  # type: ignore[assignment]
        pipe = self.client.pipeline(transaction=False)
        for session_id in ids:
            pipe.hgetall(self._keys(session_id)[0])
        return [_record(s, f) for s, f in zip(ids, pipe.execute(), strict=True) if f]

    @_unavailable_on_connection_error
    def count(self) -> int:
        return int(self.client.zcard(self._index))

    @_unavailable_on_connection_error
    def append_turn(self, session_id, expected_turns, messages, worker, footprint, now) -> int:
        payload = [json.dumps(m.to_dict()) for m in messages]
        result = int(
            self._append(keys=self._keys(session_id), args=[expected_turns, now, worker, footprint, *payload])
        )
        if result == -1:
            raise NotFound(f"unknown session {session_id!r}")
        if result == -2:
            raise Conflict(f"session {session_id!r}: another turn was recorded first")
        return result

    @_unavailable_on_connection_error
    def set_placement(self, session_id: str, worker: str, footprint: int) -> None:
        self._place(keys=[self._keys(session_id)[0]], args=[worker, footprint])

    @_unavailable_on_connection_error
    def delete(self, session_id: str) -> bool:
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(*self._keys(session_id))
        pipe.zrem(self._index, session_id)
        deleted, _ = pipe.execute()
        return deleted > 0

    def close(self) -> None:
        self.client.close()


def _meta_fields(record: SessionRecord) -> dict:
    return {
        "model": record.model,
        "policy": record.policy,
        "max_new_tokens": record.max_new_tokens,
        "worker": record.worker,
        "footprint": record.footprint_bytes,
        "created": record.created_at,
        "updated": record.updated_at,
        "turns": record.turns,
    }


def _record(session_id: str, fields: dict) -> SessionRecord:
    return SessionRecord(
        session_id=session_id,
        model=fields["model"],
        policy=fields["policy"],
        max_new_tokens=int(fields.get("max_new_tokens", 256)),
        worker=fields.get("worker", ""),
        footprint_bytes=int(fields.get("footprint", 0)),
        created_at=float(fields.get("created", 0)),
        updated_at=float(fields.get("updated", 0)),
        turns=int(fields.get("turns", 0)),
    )
