"""Session store: an interface, an in-memory implementation and a Redis one (redis-py).

The store is the source of truth for transcripts (a worker's copy is only a cache). Every
acknowledged turn is written atomically (one Lua script: check the request id and the turn
number, append the user message and the reply, remember the request id with the reply, update
metadata) before the scheduler acknowledges it. A retry with the same request id finds the turn
already recorded instead of recording it twice, so a client may always retry a turn whose
outcome it does not know. Any Redis error raises ``StoreUnavailable`` saying only what is known:
a failed read recorded nothing; a failed write may or may not have been applied. redis-py
reconnects by itself, so service recovers as soon as Redis is back.

Retention: every key of a session expires ``retention_s`` after its last write (None = never).
"""

from __future__ import annotations

import builtins
import copy
import dataclasses
import functools
import json
import secrets
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from scheduler_svc.domain import Message, SessionRecord
from scheduler_svc.errors import Conflict, NotFound, StoreUnavailable

DEFAULT_RETENTION_S = 7 * 24 * 3600.0  # a session nobody writes to for a week is deleted


def new_session_id() -> str:
    """128 random bits, URL-safe: unguessable, and scoped to its owner anyway."""
    return secrets.token_urlsafe(16)


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
    def create(self, record: SessionRecord) -> None: ...

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
        self._touched: dict[str, float] = {}
        self._lock = threading.Lock()
        self.retention_s, self.clock = retention_s, clock

    def _expire(self) -> None:  # lock held
        if self.retention_s is None:
            return
        cutoff = self.clock() - self.retention_s
        for session_id in [s for s, t in self._touched.items() if t < cutoff]:
            self._forget(session_id)

    def _forget(self, session_id: str) -> bool:
        self._touched.pop(session_id, None)
        self._requests.pop(session_id, None)
        return self._records.pop(session_id, None) is not None

    def create(self, record: SessionRecord) -> None:
        with self._lock:
            self._records[record.session_id] = copy.deepcopy(record)
            self._touched[record.session_id] = self.clock()

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


# KEYS: meta, transcript, requests. ARGV: expected turns, now, worker, footprint, request id,
# ttl seconds (0 = none), the reply (for the request record), then the messages (JSON).
_APPEND_TURN = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1, ''} end
if ARGV[5] ~= '' then
  local seen = redis.call('HGET', KEYS[3], ARGV[5])
  if seen then return {-3, seen} end
end
local turns = tonumber(redis.call('HGET', KEYS[1], 'turns'))
if turns ~= tonumber(ARGV[1]) then return {-2, ''} end
for i = 8, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
redis.call('HSET', KEYS[1], 'turns', turns + 1, 'updated', ARGV[2], 'worker', ARGV[3], 'footprint', ARGV[4])
local record = cjson.encode({turn = turns + 1, reply = ARGV[7], worker = ARGV[3],
                             footprint = tonumber(ARGV[4])})
if ARGV[5] ~= '' then redis.call('HSET', KEYS[3], ARGV[5], record) end
local ttl = tonumber(ARGV[6])
if ttl > 0 then
  for i = 1, 3 do if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('EXPIRE', KEYS[i], ttl) end end
end
return {turns + 1, record}
"""

_SET_PLACEMENT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'worker', ARGV[1], 'footprint', ARGV[2])
return 1
"""


def _store_errors(write: bool):
    """Any Redis error -> StoreUnavailable, claiming only what is known: a read changed nothing;
    a write may have been applied (Redis can apply a buffered command after a timeout)."""

    def decorate(method):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            import redis

            try:
                return method(self, *args, **kwargs)
            except redis.exceptions.RedisError as err:
                outcome = (
                    "the write may or may not have been applied; retry with the same request id"
                    if write
                    else "nothing was changed; retry later"
                )
                raise StoreUnavailable(
                    f"session store unavailable (Redis at {self.url}: {type(err).__name__}); {outcome}"
                ) from None

        return wrapper

    return decorate


_unavailable_on_connection_error = _store_errors(write=False)
_unknown_outcome_on_error = _store_errors(write=True)


class RedisStore(SessionStore):
    """Keys: ``{prefix}s:{id}`` hash of metadata, ``{prefix}t:{id}`` list of JSON messages,
    ``{prefix}q:{id}`` hash request id -> recorded turn, ``{prefix}index`` sorted set of all ids
    and ``{prefix}own:{owner}`` of each owner's ids, by creation time (expired ids are pruned
    when listed)."""

    def __init__(
        self,
        url: str,
        prefix: str = "confkv:",
        timeout_s: float = 2.0,
        retention_s: float | None = DEFAULT_RETENTION_S,
    ) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        if not prefix:
            raise ValueError("the Redis key prefix must not be empty")
        self.url, self.prefix = url, prefix
        self.ttl = int(retention_s) if retention_s else 0
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

    def _requests(self, session_id: str) -> str:
        return f"{self.prefix}q:{session_id}"

    @property
    def _index(self) -> str:
        return f"{self.prefix}index"

    def _owned(self, owner: str) -> str:
        return f"{self.prefix}own:{owner}"

    @_unavailable_on_connection_error
    def ping(self) -> None:
        self.client.ping()

    @_unknown_outcome_on_error
    def create(self, record: SessionRecord) -> None:
        meta, transcript = self._keys(record.session_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(meta, mapping=_meta_fields(record))
        if record.transcript:
            pipe.rpush(transcript, *(json.dumps(m.to_dict()) for m in record.transcript))
        if self.ttl:
            pipe.expire(meta, self.ttl)
            if record.transcript:
                pipe.expire(transcript, self.ttl)
        pipe.zadd(self._index, {record.session_id: record.created_at})
        pipe.zadd(self._owned(record.owner), {record.session_id: record.created_at})
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
    def list(self, owner: str, limit: int = 100, offset: int = 0) -> list[SessionRecord]:
        key = self._owned(owner)
        ids: list[str] = self.client.zrevrange(key, offset, offset + max(limit, 1) - 1)  # type: ignore[assignment]
        pipe = self.client.pipeline(transaction=False)
        for session_id in ids:
            pipe.hgetall(self._keys(session_id)[0])
        found = dict(zip(ids, pipe.execute(), strict=True))
        expired = [s for s, f in found.items() if not f]
        if expired:  # retention removed them: prune the indexes
            self.client.zrem(key, *expired)
            self.client.zrem(self._index, *expired)
        return [_record(s, f) for s, f in found.items() if f]

    @_unavailable_on_connection_error
    def count(self) -> int:
        return int(self.client.zcard(self._index))

    @_unknown_outcome_on_error
    def append_turn(
        self, session_id, expected_turns, messages, worker, footprint, now, request_id=""
    ) -> RecordedTurn:
        payload = [json.dumps(m.to_dict()) for m in messages]
        reply = messages[-1].content if messages else ""
        keys = [*self._keys(session_id), self._requests(session_id)]
        args = [expected_turns, now, worker, footprint, request_id, self.ttl, reply, *payload]
        code, record = self._append(keys=keys, args=args)
        code = int(code)
        if code == -1:
            raise NotFound(f"unknown session {session_id!r}")
        if code == -2:
            raise Conflict(f"session {session_id!r}: another turn was recorded first")
        return dataclasses.replace(RecordedTurn.from_json(record), replayed=code == -3)

    @_unavailable_on_connection_error
    def recorded(self, session_id: str, request_id: str) -> RecordedTurn | None:
        found = self.client.hget(self._requests(session_id), request_id)
        return RecordedTurn.from_json(found) if found else None  # type: ignore[arg-type]

    @_unknown_outcome_on_error
    def set_placement(self, session_id: str, worker: str, footprint: int) -> None:
        self._place(keys=[self._keys(session_id)[0]], args=[worker, footprint])

    @_unknown_outcome_on_error
    def delete(self, session_id: str) -> bool:
        owner = self.client.hget(self._keys(session_id)[0], "owner") or ""
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(*self._keys(session_id), self._requests(session_id))
        pipe.zrem(self._index, session_id)
        pipe.zrem(self._owned(str(owner)), session_id)
        deleted = pipe.execute()[0]
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
        "owner": record.owner,
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
        owner=fields.get("owner", ""),
    )
