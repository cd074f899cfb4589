"""The scheduler core in-process with fake workers: turns, resume, idle release, admission
queueing, restart, bad input."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from scheduler_svc.cluster import Cluster
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core import Scheduler
from scheduler_svc.domain import Message, QueuedEvent, TokenEvent, TurnDone
from scheduler_svc.errors import (
    Conflict,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SchedulerError,
    Unavailable,
)
from scheduler_svc.store import MemoryStore
from tests.helpers import GEOMETRY, FakeWorker, reply_for

POLICY = "window:n=16"  # reservation: 16 tokens of FP KV in every layer
NEED = GEOMETRY.full_bytes(16)


def make(capacities=(10 * NEED, 10 * NEED), store=None, **config):
    workers = [FakeWorker(f"w{i}:1", c) for i, c in enumerate(capacities)]
    cfg = SchedulerConfig(**{"poll_interval_s": 0.05, "admission_timeout_s": 5.0, **config})
    sched = Scheduler(store or MemoryStore(), workers, cfg)
    sched.start(background=False)
    return sched, workers


def run_turn(sched, sid, text, **kw):
    events = list(sched.chat(sid, Message("user", text), **kw))
    done = events[-1]
    assert isinstance(done, TurnDone)
    streamed = "".join(e.text for e in events if isinstance(e, TokenEvent))
    assert streamed == done.result.reply
    return done


def test_multi_turn_conversation_is_recorded():
    sched, workers = make()
    session = sched.create_session(policy=POLICY, messages=[Message("system", "be brief")])
    assert session.model == "tiny"
    first = run_turn(sched, session.session_id, "hello there")
    assert first.turn == 1 and first.footprint_bytes == NEED
    second = run_turn(sched, session.session_id, "how are you")
    view = sched.get_session(session.session_id)
    # idle: the KV stays on its worker, but no reservation is held between turns
    assert view.record.turns == 2 and view.state == "idle" and view.reserved_bytes == 0
    assert [m.role for m in view.record.transcript] == ["system", "user", "assistant", "user", "assistant"]
    assert view.record.transcript[-1].content == second.result.reply
    assert sum(w.opens for w in workers) == 1  # the KV stayed on its worker between turns


def test_worker_death_between_turns_replays_the_transcript_elsewhere():
    sched, workers = make()
    sid = sched.create_session(policy=POLICY).session_id
    first = run_turn(sched, sid, "one two")
    victim = next(w for w in workers if w.address == first.worker)
    survivor = next(w for w in workers if w is not victim)
    victim.dead = True
    second = run_turn(sched, sid, "three four")
    assert second.worker == survivor.address
    transcript = sched.get_session(sid).record.transcript
    # the survivor rebuilt the session from the stored transcript, so its reply saw both turns
    assert second.result.reply == reply_for(transcript[:-1])
    assert [m.content for m in transcript[:2]] == ["one two", first.result.reply]


def test_worker_death_mid_turn_loses_nothing_acknowledged():
    sched, workers = make()
    sid = sched.create_session(policy=POLICY).session_id
    first = run_turn(sched, sid, "a b c d")
    victim = next(w for w in workers if w.address == first.worker)
    stream = sched.chat(sid, Message("user", "e f g h"))
    assert isinstance(next(stream), TokenEvent)
    victim.dead = True
    with pytest.raises(Unavailable, match="not recorded"):
        list(stream)
    assert sched.get_session(sid).record.turns == 1
    third = run_turn(sched, sid, "e f g h")
    assert third.turn == 2 and third.worker != victim.address


def test_idle_ttl_releases_kv_but_keeps_the_transcript():
    clock = [0.0]
    sched, workers = make(idle_ttl_s=10.0)
    sched.cluster.clock = lambda: clock[0]
    sid = sched.create_session(policy=POLICY).session_id
    first = run_turn(sched, sid, "remember me")
    clock[0] = 11.0
    sched.tick()
    assert sched.get_session(sid).state == "released"
    assert all(sid not in w.sessions for w in workers)
    second = run_turn(sched, sid, "again")
    assert second.turn == 2 and sched.get_session(sid).record.transcript[1].content == first.result.reply


def running_turn(sched, workers, sid):
    """Start a turn that holds its reservation until ``release()``; returns (thread, release)."""
    gate = threading.Event()
    for w in workers:
        w.gate = gate
    events: list = []
    stream = sched.chat(sid, Message("user", "first turn holds the room"))
    events.append(next(stream))  # the first token: placed and running
    thread = threading.Thread(target=lambda: events.extend(stream))
    thread.start()

    def release():
        gate.set()
        thread.join(10)
        for w in workers:
            w.gate = None
        return events

    return release


def test_admission_queues_when_full_and_admits_in_order():
    sched, workers = make(capacities=(NEED,), queue_limit=1, admission_timeout_s=5.0)
    a = sched.create_session(policy=POLICY).session_id
    b = sched.create_session(policy=POLICY).session_id
    c = sched.create_session(policy=POLICY).session_id
    release = running_turn(sched, workers, a)
    waiting = sched.chat(b, Message("user", "second"))
    assert next(waiting) == QueuedEvent(1, f"waiting for {NEED} bytes of KV room")
    with pytest.raises(ResourceExhausted, match="queue is full"):
        list(sched.chat(c, Message("user", "third")))
    rest: list = []
    thread = threading.Thread(target=lambda: rest.extend(waiting))
    thread.start()
    assert isinstance(release()[-1], TurnDone)  # a's turn ends: its reservation goes, b is admitted
    thread.join(10)
    assert isinstance(rest[-1], TurnDone) and workers[0].used() <= NEED


def test_idle_sessions_hold_no_reservation():
    """Room for one running turn, five sessions taking turns in sequence: nobody waits."""
    sched, workers = make(capacities=(NEED,), admission_timeout_s=0.5)
    sids = [sched.create_session(policy=POLICY).session_id for _ in range(5)]
    for round_ in range(2):
        for sid in sids:
            assert run_turn(sched, sid, f"round {round_}").turn == round_ + 1
    assert sched.stats().workers[0].reserved_bytes == 0


def test_admission_times_out_and_never_fits():
    sched, workers = make(capacities=(NEED,), admission_timeout_s=0.2)
    a = sched.create_session(policy=POLICY).session_id
    b = sched.create_session(policy=POLICY).session_id
    release = running_turn(sched, workers, a)
    with pytest.raises(ResourceExhausted, match="after waiting"):
        list(sched.chat(b, Message("user", "second")))
    release()
    with pytest.raises(ResourceExhausted, match="could never run"):
        sched.create_session(policy="window:n=64")


def test_a_turn_waiting_for_host_room_says_so_when_it_times_out():
    """A recall=1 turn can wait for host (cold-tier) room while KV room is free; the timeout
    once named only its KV bytes."""
    worker = FakeWorker("w0:1", 10 * NEED)
    cluster = Cluster([worker], SchedulerConfig(admission_timeout_s=0.1, poll_interval_s=0.05))
    others = {"session_bytes": {"x": 0}, "session_cold_bytes": {"x": 90}}  # placed by someone else
    cluster.placer.update(replace(worker.report(), host_capacity_bytes=100, host_used_bytes=90, **others))
    ticket = cluster.request("s", "tiny", NEED, host_need=50)
    assert ticket.address is None
    with pytest.raises(ResourceExhausted, match=f"no KV room for {NEED} bytes .and 50 host bytes"):
        cluster.wait(ticket)


def test_a_turn_cancelled_while_queued_leaves_the_queue_at_once():
    sched, workers = make(capacities=(NEED,), queue_limit=1, admission_timeout_s=30.0)
    a = sched.create_session(policy=POLICY).session_id
    b = sched.create_session(policy=POLICY).session_id
    release = running_turn(sched, workers, a)
    gone = threading.Event()
    waiting = sched.chat(b, Message("user", "second"), cancelled=gone)
    assert isinstance(next(waiting), QueuedEvent)
    errors: list = []

    def consume():
        try:
            list(waiting)
        except SchedulerError as err:
            errors.append(err)

    thread = threading.Thread(target=consume)
    thread.start()
    gone.set()
    sched.cluster.wake()
    thread.join(2)
    assert not thread.is_alive() and errors and errors[0].code == "CANCELLED"
    assert sched.stats().queued == 0
    release()
    assert run_turn(sched, b, "again").turn == 1  # the session is not locked


def test_scheduler_restart_continues_from_the_store():
    store = MemoryStore()
    sched, workers = make(store=store)
    sid = sched.create_session(policy=POLICY).session_id
    first = run_turn(sched, sid, "before restart")
    orphan = workers[1 - int(first.worker[1])]
    orphan.open("orphan", POLICY, [])
    sched.stop()
    restarted = Scheduler(store, workers, SchedulerConfig(poll_interval_s=0.05))
    restarted.start(background=False)
    assert "orphan" not in orphan.sessions  # nobody owns it: dropped
    # the store is the truth: workers' copies are dropped at start and replayed from the store
    assert all(sid not in w.sessions for w in workers)
    run_turn(restarted, sid, "after restart")
    assert sum(w.opens for w in workers) == 3  # 1 + the orphan + the replay
    assert restarted.get_session(sid).record.turns == 2


def test_bad_input_is_rejected_before_any_work():
    sched, workers = make(default_policy=POLICY)
    with pytest.raises(InvalidArgument, match="unknown policy"):
        sched.create_session(policy="nope")
    with pytest.raises(InvalidArgument, match="no worker serves"):
        sched.create_session(model="gpt-9")
    with pytest.raises(InvalidArgument, match="role"):
        sched.create_session(messages=[Message("robot", "x")])
    sid = sched.create_session(policy=POLICY).session_id
    for text, match in [("", "empty"), ("x" * 40_000, "exceeds the limit")]:
        with pytest.raises(InvalidArgument, match=match):
            sched.chat(sid, Message("user", text))
    with pytest.raises(InvalidArgument, match="max_new_tokens"):
        sched.chat(sid, Message("user", "hi"), max_new_tokens=-1)
    for bad in (-1, 1e-38, float("nan"), float("inf"), 5e-324):
        with pytest.raises(InvalidArgument, match="temperature"):
            sched.chat(sid, Message("user", "hi"), temperature=bad)
    with pytest.raises(InvalidArgument, match="session id"):
        sched.chat("", Message("user", "hi"))
    with pytest.raises(NotFound):
        sched.chat("no-such-session", Message("user", "hi"))
    with pytest.raises(NotFound):
        sched.end_session("no-such-session")
    with pytest.raises(InvalidArgument):
        sched.list_sessions(limit=0)
    stream = sched.chat(sid, Message("user", "one two three"))
    next(stream)
    with pytest.raises(Conflict, match="in flight"):
        sched.chat(sid, Message("user", "again"))
    stream.close()  # the client went away mid-turn: nothing recorded, KV dropped
    assert sched.get_session(sid).record.turns == 0 and all(sid not in w.sessions for w in workers)
    assert run_turn(sched, sid, "works").turn == 1


def test_all_workers_down_is_unavailable_then_recovers():
    sched, workers = make()
    sid = sched.create_session(policy=POLICY).session_id
    for w in workers:
        w.dead = True
    sched.tick()
    with pytest.raises(Unavailable, match="no healthy worker"):
        list(sched.chat(sid, Message("user", "hi")))
    stats = sched.stats()
    assert not any(w.healthy for w in stats.workers) and "down" in stats.workers[0].error
    workers[0].dead = False
    sched.tick()
    assert run_turn(sched, sid, "hi").worker == workers[0].address


def test_sessions_belong_to_their_principal():
    sched, _ = make()
    mine = sched.create_session(policy=POLICY, principal="alice").session_id
    assert run_turn(sched, mine, "hi", principal="alice").turn == 1
    for call in (
        lambda: sched.get_session(mine, "bob"),
        lambda: sched.chat(mine, Message("user", "inject"), principal="bob"),
        lambda: sched.end_session(mine, "bob"),
    ):
        with pytest.raises(NotFound):
            call()
    assert [v.record.session_id for v in sched.list_sessions(principal="alice")] == [mine]
    assert sched.list_sessions(principal="bob") == []
    assert sched.get_session(mine, "alice").record.turns == 1


def test_a_retried_request_id_is_answered_from_the_store():
    sched, workers = make()
    sid = sched.create_session(policy=POLICY).session_id
    first = run_turn(sched, sid, "once only", request_id="req-1")
    events = list(sched.chat(sid, Message("user", "once only"), request_id="req-1"))
    assert len(events) == 1 and events[0].replayed and events[0].turn == first.turn
    assert events[0].result.reply == first.result.reply
    assert sched.get_session(sid).record.turns == 1


def test_workers_are_reconciled_after_a_blip():
    """A worker marked down and back keeps nothing the scheduler did not place there."""
    sched, workers = make(capacities=(10 * NEED,))
    sid = sched.create_session(policy=POLICY).session_id
    run_turn(sched, sid, "hello")
    workers[0].dead = True
    sched.tick()  # marked down: the scheduler forgets the placement
    sched.end_session(sid)  # nobody to tell now
    workers[0].dead = False
    assert sid in workers[0].sessions
    sched.tick()  # back: reconciled
    assert workers[0].sessions == {} and workers[0].used() == 0
