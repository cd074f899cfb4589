"""The Redis session store (redis-py): Lua scripts make each write atomic (see ``store.py`` for
the contract every store keeps)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json

from scheduler_svc.domain import Message, SessionRecord
from scheduler_svc.errors import Conflict, NotFound, StoreUnavailable
from scheduler_svc.store import (
    DEFAULT_RETENTION_S,
    RecordedTurn,
    SessionStore,
    ended,
    request_ttl_s,
)

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

# KEYS: meta, transcript, index, owned[, create request]. ARGV: session id, created, ttl seconds
# (0 = none), request ttl seconds, N = count of meta arguments, N meta field/value arguments,
# then the messages (JSON). -> {1, id} created, or {0, id} the request id's earlier session.
_CREATE = """
if #KEYS == 5 then
  local existing = redis.call('GET', KEYS[5])
  if existing then return {0, existing} end
end
local n = tonumber(ARGV[5])
redis.call('HSET', KEYS[1], unpack(ARGV, 6, 5 + n))
for i = 6 + n, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
local ttl = tonumber(ARGV[3])
if ttl > 0 then
  for i = 1, 2 do if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('EXPIRE', KEYS[i], ttl) end end
end
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[1])
if #KEYS == 5 then redis.call('SET', KEYS[5], ARGV[1], 'EX', tonumber(ARGV[4])) end
return {1, ARGV[1]}
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
    when listed), ``{prefix}cr:{len(owner)}:{owner}:{request id}`` -> the id a create made."""

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
        self.request_ttl = int(request_ttl_s(retention_s))
        self.client = redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        self._append = self.client.register_script(_APPEND_TURN)
        self._create = self.client.register_script(_CREATE)
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

    def _create_request(self, owner: str, request_id: str) -> str:
        return f"{self.prefix}cr:{len(owner)}:{owner}:{request_id}"  # the length: no two pairs collide

    @_unavailable_on_connection_error
    def ping(self) -> None:
        self.client.ping()

    @_unknown_outcome_on_error
    def create(self, record: SessionRecord, request_id: str = "") -> SessionRecord:
        keys = [*self._keys(record.session_id), self._index, self._owned(record.owner)]
        if request_id:
            keys.append(self._create_request(record.owner, request_id))
        fields = [str(v) for pair in _meta_fields(record).items() for v in pair]
        messages = [json.dumps(m.to_dict()) for m in record.transcript]
        args: list[str | int | float] = [record.session_id, record.created_at, self.ttl, self.request_ttl]
        args += [len(fields), *fields, *messages]
        created, session_id = self._create(keys=keys, args=args)
        if int(created):
            return copy.deepcopy(record)
        try:
            return self.get(session_id)
        except NotFound:
            raise ended(session_id, request_id) from None

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
