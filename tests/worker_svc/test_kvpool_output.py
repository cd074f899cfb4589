"""KVPool keeps sum(reserved) <= capacity under random traffic; output never stores a cut
character; an exception in one turn's step fails that turn only."""

from __future__ import annotations

import random

import pytest

from worker_svc.codec import ByteChatCodec
from worker_svc.kvpool import KVPool
from worker_svc.output import Detokenizer
from worker_svc.types import ChatMessage, FinishReason, TurnDone, TurnFailed, TurnRequest


def test_pool_invariant_under_random_reserve_shrink_release():
    rng = random.Random(0)
    pool = KVPool("hot", 10_000)
    idle: list[str] = []
    evicted: list[str] = []
    for step in range(2000):
        owner = f"s{rng.randrange(12)}"
        op = rng.random()
        if op < 0.5:
            if pool.reserve(owner, rng.randrange(0, 6000), list(idle), evicted.append):
                idle = [o for o in idle if o != owner and pool.reserved(o)]
        elif op < 0.8:
            pool.shrink(owner, rng.randrange(0, 3000))
            if pool.reserved(owner) and owner not in idle:
                idle.append(owner)
        else:
            pool.release(owner)
        assert pool.reserved_bytes <= pool.capacity_bytes, step
    assert not pool.reserve("big", 10_001)
    with pytest.raises(ValueError):
        pool.reserve("neg", -1)


def test_reserve_evicts_idle_owners_least_recent_first():
    pool = KVPool("hot", 100)
    for owner in ("old", "new"):
        assert pool.reserve(owner, 40)
    evicted: list[str] = []
    assert pool.reserve("turn", 50, ["old", "new"], evicted.append)
    assert evicted == ["old"] and pool.reserved_bytes == 90


def test_reserve_releases_the_demoted_when_demoting_all_is_not_enough():
    pool = KVPool("hot", 100)
    for owner in ("old", "new"):
        assert pool.reserve(owner, 40)
    asked: list[str] = []

    def demote_then_release(victim: str) -> int:  # the engine's _make_room: demote, then release
        asked.append(victim)
        return 0 if asked.count(victim) > 1 else 10

    assert pool.reserve("turn", 85, ["old", "new"], demote_then_release)
    assert asked == ["old", "new", "old"] and pool.reserved("old") == 0 and pool.reserved("new") == 10
    assert pool.reserved_bytes == 95


def test_a_reply_cut_mid_character_is_not_stored_with_a_replacement_char():
    out = Detokenizer(ByteChatCodec())
    ids = list("né".encode())  # the last character is two bytes
    deltas = [out.push(i) for i in ids[:-1]]  # cut after the first byte of "é"
    assert "".join(deltas) == "n" and out.final() == "n"
    assert "\ufffd" not in out.final()


def test_an_exception_in_one_turn_fails_only_that_turn(make_engine, monkeypatch):
    engine = make_engine()
    for sid in ("good", "bad"):
        engine.open_session(sid, "window:n=24", [])
    good = engine.submit(
        TurnRequest("good", (ChatMessage("user", "hello"),), max_new_tokens=6, ignore_eos=True)
    )
    bad = engine.submit(
        TurnRequest("bad", (ChatMessage("user", "hello"),), max_new_tokens=6, ignore_eos=True)
    )
    original = engine._emit_next

    def emit(turn):
        if turn.session.session_id == "bad":
            raise RuntimeError("sampling blew up")
        return original(turn)

    monkeypatch.setattr(engine, "_emit_next", emit)
    engine.run_until_idle()
    events = [good.events.get_nowait() for _ in range(good.events.qsize())]
    assert isinstance(events[-1], TurnDone) and events[-1].reason is FinishReason.MAX_TOKENS
    assert isinstance(bad.events.get_nowait(), TurnFailed)
    assert engine.footprint().used_bytes == engine.sessions["good"].nbytes()
    assert engine.sessions["bad"].seq is None and engine.pool.reserved("bad") == 0
