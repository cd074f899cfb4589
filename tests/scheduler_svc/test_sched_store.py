"""Session stores: the in-memory one and Redis (own key prefix on the shared server)."""

from __future__ import annotations

import pytest

from scheduler_svc.domain import Message, SessionRecord
from scheduler_svc.errors import Conflict, NotFound, StoreUnavailable
from scheduler_svc.store import MemoryStore, new_session_id
from scheduler_svc.store_redis import RedisStore
from tests.helpers import PrivateRedis, delete_prefix, free_port, shared_redis_or_skip, unique_prefix


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def store(request):
    if request.param == "memory":
        yield MemoryStore()
        return
    client = shared_redis_or_skip()
    prefix = unique_prefix()
    redis_store = RedisStore("redis://127.0.0.1:6379/0", prefix=prefix)
    try:
        yield redis_store
    finally:
        redis_store.close()
        delete_prefix(client, prefix)


def record(created=1.0, transcript=()):
    return SessionRecord(
        new_session_id(), "tiny", "window:n=64", transcript=list(transcript), created_at=created
    )


def test_session_ids_are_unguessable():
    ids = {new_session_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(len(i) >= 22 for i in ids)


def test_session_ids_never_begin_with_a_dash(monkeypatch):
    """One random id in 64 would, and a command line (``confkv sessions show ID``) would read it
    as an option: such draws are replaced."""
    import scheduler_svc.store

    draws = iter(["-tjdJmbLMNwhDs6B3mSPDQ", "--bJmbLMNwhDs6B3mSPDQ", "ClhPlFB-ZkUsX9P5okq3_Q"])
    monkeypatch.setattr(scheduler_svc.store.secrets, "token_urlsafe", lambda n: next(draws))
    assert new_session_id() == "ClhPlFB-ZkUsX9P5okq3_Q"


def test_round_trip_and_turns(store):
    rec = record(transcript=[Message("system", "be brief")])
    store.create(rec)
    got = store.get(rec.session_id)
    assert (got.model, got.policy, got.turns, got.transcript) == ("tiny", "window:n=64", 0, rec.transcript)
    turn = [Message("user", "hi"), Message("assistant", "hello ✓")]
    assert store.append_turn(rec.session_id, 0, turn, "w1:1", 4096, 2.0).turn == 1
    got = store.get(rec.session_id)
    assert got.transcript == rec.transcript + turn
    assert (got.turns, got.worker, got.footprint_bytes, got.updated_at) == (1, "w1:1", 4096, 2.0)
    # a stale writer (expects 0 turns) cannot append a second copy
    with pytest.raises(Conflict):
        store.append_turn(rec.session_id, 0, turn, "w1:1", 4096, 3.0)
    assert store.get(rec.session_id).turns == 1


def test_placement_list_count_delete(store):
    recs = [record(created=float(i)) for i in range(3)]
    for rec in recs:
        store.create(rec)
    store.set_placement(recs[0].session_id, "w2:2", 123)
    got = store.get(recs[0].session_id)
    assert (got.worker, got.footprint_bytes) == ("w2:2", 123)
    assert [r.session_id for r in store.list("", 2)] == [recs[2].session_id, recs[1].session_id]
    assert [r.session_id for r in store.list("", 2, offset=2)] == [recs[0].session_id]
    assert store.count() == 3
    assert store.delete(recs[0].session_id) is True
    assert store.delete(recs[0].session_id) is False
    store.set_placement(recs[0].session_id, "w2:2", 1)  # does not resurrect it
    with pytest.raises(NotFound):
        store.get(recs[0].session_id)
    with pytest.raises(NotFound):
        store.append_turn(recs[0].session_id, 0, [], "", 0, 0.0)
    assert store.count() == 2


def test_unreachable_redis_is_unavailable_with_a_clear_message():
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    with pytest.raises(StoreUnavailable, match="session store unavailable.*nothing was changed"):
        store.get("abc")
    with pytest.raises(StoreUnavailable):
        store.create(record())


@pytest.mark.redis
def test_store_recovers_when_redis_comes_back():
    server = PrivateRedis()
    server.start()
    store = RedisStore(server.url, prefix="t:", timeout_s=0.5)
    try:
        rec = record()
        store.create(rec)
        server.stop()
        with pytest.raises(StoreUnavailable):
            store.append_turn(rec.session_id, 0, [Message("user", "x")], "", 0, 1.0)
        server.start()  # --save '': data is gone, but the client reconnects by itself
        store.create(rec)
        assert store.append_turn(rec.session_id, 0, [Message("user", "x")], "", 0, 1.0).turn == 1
    finally:
        store.close()
        server.stop()


def test_a_request_id_is_recorded_once_and_sessions_are_scoped_to_owners(store):
    mine, theirs = record(), record()
    mine.owner, theirs.owner = "alice", "bob"
    store.create(mine)
    store.create(theirs)
    turn = [Message("user", "hi"), Message("assistant", "hello")]
    first = store.append_turn(mine.session_id, 0, turn, "w:1", 10, 1.0, request_id="r1")
    again = store.append_turn(mine.session_id, 0, turn, "w:1", 10, 2.0, request_id="r1")
    assert (first.turn, first.replayed, again.turn, again.replayed) == (1, False, 1, True)
    assert store.get(mine.session_id).turns == 1 and len(store.get(mine.session_id).transcript) == 2
    assert store.recorded(mine.session_id, "r1").reply == "hello"
    assert store.recorded(mine.session_id, "r2") is None
    assert [r.session_id for r in store.list("alice")] == [mine.session_id]
    assert [r.session_id for r in store.list("bob")] == [theirs.session_id]
    assert store.list("mallory") == []
    assert store.get(mine.session_id).owner == "alice"


def test_memory_sessions_expire_after_the_retention():
    now = [100.0]
    store = MemoryStore(retention_s=10.0, clock=lambda: now[0])
    rec = record()
    store.create(rec)
    now[0] += 9.0
    store.append_turn(rec.session_id, 0, [Message("user", "x")], "", 0, now[0])  # a write refreshes it
    now[0] += 9.0
    assert store.get(rec.session_id).turns == 1
    now[0] += 11.0
    with pytest.raises(NotFound):
        store.get(rec.session_id)


@pytest.mark.redis
def test_redis_keys_carry_the_retention_ttl():
    client = shared_redis_or_skip()
    prefix = unique_prefix()
    store = RedisStore("redis://127.0.0.1:6379/0", prefix=prefix, retention_s=1000)
    try:
        rec = record(transcript=[Message("system", "s")])
        store.create(rec)
        store.append_turn(rec.session_id, 0, [Message("user", "x")], "", 0, 1.0, request_id="r")
        for key in (
            f"{prefix}s:{rec.session_id}",
            f"{prefix}t:{rec.session_id}",
            f"{prefix}q:{rec.session_id}",
        ):
            assert 0 < client.ttl(key) <= 1000, key
    finally:
        store.close()
        delete_prefix(client, prefix)


def test_a_create_request_id_makes_one_session_per_owner(store):
    """A create retried after a lost reply returns the session it made; another owner's identical
    request id is another session."""
    first = record(transcript=[Message("system", "be brief")])
    first.owner = "alice"
    assert store.create(first, request_id="c1").session_id == first.session_id
    retry = record()
    retry.owner = "alice"
    again = store.create(retry, request_id="c1")
    assert again.session_id == first.session_id and again.transcript == first.transcript
    with pytest.raises(NotFound):
        store.get(retry.session_id)
    other = record()
    other.owner = "bob"
    assert store.create(other, request_id="c1").session_id == other.session_id
    assert [r.session_id for r in store.list("alice")] == [first.session_id]
    assert store.count() == 2
    store.delete(first.session_id)
    late = record()
    late.owner = "alice"
    with pytest.raises(NotFound, match="request id 'c1' created session .* which has since ended"):
        store.create(late, request_id="c1")


def test_memory_create_request_ids_expire_with_the_retention():
    now = [0.0]
    store = MemoryStore(retention_s=10.0, clock=lambda: now[0])
    first = store.create(record(), request_id="c")
    now[0] += 5.0
    assert store.create(record(), request_id="c").session_id == first.session_id
    now[0] += 6.0  # the request id (and the idle session) expired: a new session
    assert store.create(record(), request_id="c").session_id != first.session_id


@pytest.mark.redis
def test_redis_create_request_key_is_atomic_and_carries_a_ttl():
    """Without a retention the request id is kept a day; concurrent creates with one request id
    (the Lua script runs atomically) make exactly one session."""
    import threading

    client = shared_redis_or_skip()
    prefix = unique_prefix()
    store = RedisStore("redis://127.0.0.1:6379/0", prefix=prefix, retention_s=None)
    try:
        ids: list[str] = []
        threads = [
            threading.Thread(target=lambda: ids.append(store.create(record(), request_id="same").session_id))
            for _ in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(set(ids)) == 1 and store.count() == 1
        (key,) = client.keys(f"{prefix}cr:*")
        assert client.get(key).decode() == ids[0] and 86_000 < client.ttl(key) <= 86_400
    finally:
        store.close()
        delete_prefix(client, prefix)
