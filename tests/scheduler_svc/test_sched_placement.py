"""Placement and admission by KV footprint: unit tests and a property test of the invariant
"no worker's reported bytes ever exceed its capacity"."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from confkv.memory import KVGeometry
from confkv.policies import parse_policy
from scheduler_svc.domain import WorkerReport
from scheduler_svc.errors import ResourceExhausted
from scheduler_svc.placement import AdmissionQueue, Placer, reservation_bytes

GEO = KVGeometry(n_layers=4, n_kv_heads=2, head_dim=16, dtype_bytes=4)


def report(address, capacity, sessions=None, model="m"):
    sessions = sessions or {}
    return WorkerReport(address, model, GEO, 1024, capacity, sum(sessions.values()), sessions)


def test_reservation_is_policy_bound_or_full_context():
    window = parse_policy("window:n=64")
    assert reservation_bytes(window, GEO, 1024) == window.peak_bytes_bound(GEO) == 64 * GEO.fp_token_bytes * 4
    assert reservation_bytes(parse_policy("full"), GEO, 1024) == GEO.full_bytes(1024)
    int8 = parse_policy("confkv:n_high=512,n_low=256,int8=1,w=32")
    assert reservation_bytes(int8, GEO, 1024) == int8.peak_bytes_bound(GEO) < GEO.full_bytes(512)
    # a budget larger than the context is capped by the full cache of the context
    assert reservation_bytes(parse_policy("window:n=4096"), GEO, 1024) == GEO.full_bytes(1024)
    byte_budget = parse_policy("confkv:bytes=100000")
    assert reservation_bytes(byte_budget, GEO, 1024) <= 100_000


def test_admit_picks_most_headroom_and_returns_none_when_full():
    placer = Placer()
    placer.update(report("a", 1000))
    placer.update(report("b", 600))
    assert placer.admit("s1", "m", 500) == "a"
    assert placer.admit("s2", "m", 400) == "b"  # a has 500 left, b 600
    assert placer.admit("s3", "m", 400) == "a"
    assert placer.admit("s4", "m", 300) is None
    assert placer.admit("s5", "other-model", 1) is None
    assert placer.release("s2") == 400
    assert placer.admit("s4", "m", 300) == "b"


def test_unknown_reported_bytes_are_not_double_booked():
    placer = Placer()
    placer.update(report("a", 1000, {"foreign": 700}))
    assert placer.admit("s1", "m", 400) is None
    assert placer.admit("s1", "m", 300) == "a"
    # once the foreign session is gone from the report, its room comes back
    placer.update(report("a", 1000, {"s1": 10}))
    assert placer.admit("s2", "m", 700) == "a"


def test_recall_turns_are_placed_where_their_cold_tier_fits():
    """A recall=1 turn reserves host bytes too: a worker whose host pool is full of others' cold
    tiers is skipped though its hot pool has room; a worker without a host limit always fits."""
    placer = Placer()
    roomy_hot = WorkerReport("a", "m", GEO, 1024, 1000, 0, {}, host_capacity_bytes=500)
    placer.update(roomy_hot)
    placer.update(WorkerReport("b", "m", GEO, 1024, 600, 0, {}, host_capacity_bytes=5000))
    assert placer.largest_host_capacity("m") == 5000
    assert placer.admit("s1", "m", 100, host_need=400) == "a"  # most hot headroom, host fits
    assert placer.admit("s2", "m", 100, host_need=400) == "b"  # a's host pool is taken by s1
    assert placer.admit("s3", "m", 100, host_need=4700) is None  # 400 + 4700 > b's 5000
    placer.finish("s2")  # the turn ended: its host reservation goes back
    assert placer.admit("s3", "m", 100, host_need=4700) == "b"
    # reported cold bytes of sessions placed elsewhere count; those of our idle sessions do not
    placer.finish("s3")
    placer.update(WorkerReport("b", "m", GEO, 1024, 600, 0, {"s3": 0, "x": 0}, host_capacity_bytes=5000,
                               host_used_bytes=4900, session_cold_bytes={"s3": 4700, "x": 200}))  # fmt: skip
    assert placer.workers["b"].host_committed_bytes == 200
    placer.update(WorkerReport("c", "m", GEO, 1024, 100, 0, {}))  # no host limit
    assert placer.largest_host_capacity("m") is None
    assert placer.admit("s4", "m", 50, host_need=10**9) == "c"
    queue = AdmissionQueue(limit=2)
    ticket = queue.push("s5", "m", 60, host_need=10**9)
    assert queue.drain(placer) == [] and ticket.address is None  # c is full now (50 + 60 > 100)
    placer.finish("s4")
    assert queue.drain(placer) == [ticket] and ticket.address == "c"


def test_mark_down_releases_and_blocks_the_worker():
    placer = Placer()
    placer.update(report("a", 1000))
    placer.admit("s1", "m", 100)
    assert placer.mark_down("a") == ["s1"]
    assert "s1" not in placer.location
    assert placer.admit("s2", "m", 1) is None
    placer.update(report("a", 1000))  # it answers again
    assert placer.admit("s2", "m", 1) == "a"


def test_queue_is_bounded_fair_and_per_model():
    placer = Placer()
    placer.update(report("a", 1000))
    placer.update(report("x", 100, model="other"))
    queue = AdmissionQueue(limit=3)
    big = queue.push("big", "m", 900)
    assert [t.session_id for t in queue.drain(placer)] == ["big"]
    first = queue.push("first", "m", 200)
    small = queue.push("small", "m", 50)  # would fit, but must not overtake "first"
    other = queue.push("o", "other", 50)  # another model's lane is not blocked
    assert [t.session_id for t in queue.drain(placer)] == ["o"]
    assert big.address == "a" and first.address is None and small.address is None
    assert queue.position(small) == 2
    queue.push("third", "m", 1)
    with pytest.raises(ResourceExhausted, match="queue is full"):
        queue.push("fourth", "m", 1)
    placer.release("big")
    assert [t.session_id for t in queue.drain(placer)] == ["first", "small", "third"]
    assert other.address == "x"


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(1, 1500)),
        st.tuples(st.just("grow"), st.integers(0, 50), st.integers(1, 800)),
        st.tuples(st.just("leave"), st.integers(0, 50)),
        st.tuples(st.just("report"), st.integers(0, 2)),
        st.tuples(st.just("restart"), st.just(0)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(capacities=st.lists(st.integers(100, 2000), min_size=1, max_size=3), ops=OPS)
def test_no_worker_ever_exceeds_its_capacity(capacities, ops):
    """Random arrivals, growth (up to each session's bound), departures, stale reports and
    scheduler restarts (placements taken back from the store): usage never exceeds capacity."""
    names = [f"w{i}" for i in range(len(capacities))]
    capacity = dict(zip(names, capacities, strict=True))
    actual: dict[str, dict[str, int]] = {n: {} for n in names}  # what workers really hold
    stored: dict[str, tuple[str, int]] = {}  # the session store: id -> (worker, reservation)
    need: dict[str, int] = {}
    placer, queue = Placer(), AdmissionQueue(limit=4)
    for n in names:
        placer.update(report(n, capacity[n]))

    def admit_waiting():
        for ticket in queue.drain(placer):
            actual[ticket.address][ticket.session_id] = 0
            stored[ticket.session_id] = (ticket.address, ticket.need)

    for step, op in enumerate(ops):
        live = sorted(stored)
        if op[0] == "arrive":
            need[f"s{step}"] = op[1]
            try:
                queue.push(f"s{step}", "m", op[1])
            except ResourceExhausted:
                pass
            admit_waiting()
        elif op[0] == "grow" and live:
            sid = live[op[1] % len(live)]
            worker = stored[sid][0]
            actual[worker][sid] = min(need[sid], actual[worker][sid] + op[2])
        elif op[0] == "leave" and live:
            sid = live[op[1] % len(live)]
            del actual[stored.pop(sid)[0]][sid]
            placer.release(sid)
            admit_waiting()
        elif op[0] == "report":
            n = names[op[1] % len(names)]
            placer.update(report(n, capacity[n], dict(actual[n])))
            admit_waiting()
        elif op[0] == "restart":
            placer, queue = Placer(), AdmissionQueue(limit=4)
            for n in names:
                placer.update(report(n, capacity[n], dict(actual[n])))
            for sid, (worker, reserved) in stored.items():
                placer.adopt(sid, worker, reserved)
        for n in names:
            assert sum(actual[n].values()) <= capacity[n]
            assert placer.workers[n].committed_bytes <= capacity[n]
