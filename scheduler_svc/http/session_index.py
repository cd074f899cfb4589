"""Prefix index: which session a stateless chat-completions call continues.

OpenAI clients send the whole conversation every call. After each turn the index maps
``hash(principal, model, transcript)`` to the session whose stored transcript that is; a call
whose messages are that transcript plus one new user (or tool) message continues the session, so
an unchanged agent loop reuses its Conf-KV cache turn after turn instead of re-reading the whole
conversation. The index is only a hint: a hit is accepted after the store confirms the
session's owner, model and transcript. It lives in memory, or in Redis (beside the sessions,
with their retention) when the store is Redis, so it survives a scheduler restart and is shared
by replicas.
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
from collections.abc import Sequence
from typing import Protocol

from scheduler_svc.domain import Message
from scheduler_svc.errors import StoreUnavailable
from scheduler_svc.store import SessionStore
from scheduler_svc.store_redis import RedisStore


def canonical(messages: Sequence[Message]) -> list[tuple[str, str]]:
    """What identifies a transcript: its non-blank messages (a blank one carries no tokens)."""
    return [(m.role, m.content) for m in messages if m.content.strip()]


def transcript_key(principal: str, model: str, messages: Sequence[Message]) -> str:
    blob = json.dumps([principal, model, canonical(messages)], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()


class PrefixIndex(Protocol):
    def get(self, key: str) -> str | None: ...

    def put(self, key: str, session_id: str) -> None: ...

    def discard(self, key: str, session_id: str) -> None:
        """Forget ``key`` if it still points at ``session_id``."""
        ...


class MemoryPrefixIndex:
    """Bounded LRU map (the oldest entries go first; a miss only costs a new session)."""

    def __init__(self, max_entries: int = 100_000) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._map: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> str | None:
        with self._lock:
            value = self._map.get(key)
            if value is not None:
                self._map.move_to_end(key)
            return value

    def put(self, key: str, session_id: str) -> None:
        with self._lock:
            self._map[key] = session_id
            self._map.move_to_end(key)
            while len(self._map) > self.max_entries:
                self._map.popitem(last=False)

    def discard(self, key: str, session_id: str) -> None:
        with self._lock:
            if self._map.get(key) == session_id:
                del self._map[key]


_DISCARD_IF_EQUAL = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisPrefixIndex:
    """``{prefix}http:prefix:{key}`` -> session id, expiring with the sessions' retention."""

    def __init__(self, store: RedisStore) -> None:
        self.client, self.url = store.client, store.url
        self.prefix = f"{store.prefix}http:prefix:"
        self.ttl = store.ttl or None
        self._discard = self.client.register_script(_DISCARD_IF_EQUAL)

    def _call(self, fn, *args):
        import redis

        try:
            return fn(*args)
        except redis.exceptions.RedisError as err:
            raise StoreUnavailable(
                f"session store unavailable (Redis at {self.url}: {type(err).__name__}); retry later"
            ) from None

    def get(self, key: str) -> str | None:
        return self._call(self.client.get, self.prefix + key)

    def put(self, key: str, session_id: str) -> None:
        self._call(lambda: self.client.set(self.prefix + key, session_id, ex=self.ttl))

    def discard(self, key: str, session_id: str) -> None:
        self._call(lambda: self._discard(keys=[self.prefix + key], args=[session_id]))


def index_for(store: SessionStore) -> PrefixIndex:
    return RedisPrefixIndex(store) if isinstance(store, RedisStore) else MemoryPrefixIndex()
