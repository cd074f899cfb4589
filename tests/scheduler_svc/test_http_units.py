"""Transport-free pieces of the HTTP front door: stop matching, the prefix index (memory and
Redis), the error mapping, and ``--http-port`` refusals on the command line (exit 2)."""

from __future__ import annotations

import socket

import pytest

from confkv_serve.commands import main
from scheduler_svc.domain import Message, TokenEvent, TurnResult
from scheduler_svc.errors import Conflict, InvalidArgument, ResourceExhausted, StoreUnavailable, WorkerRefused
from scheduler_svc.http.errors import from_scheduler
from scheduler_svc.http.session_index import MemoryPrefixIndex, RedisPrefixIndex, transcript_key
from scheduler_svc.stops import StopMatcher, check_stops, cut_result
from scheduler_svc.store_redis import RedisStore
from tests.helpers import delete_prefix, shared_redis_or_skip, unique_prefix


@pytest.mark.parametrize(
    ("deltas", "stops", "released", "matched"),
    [
        (["Hello ", "wor", "ld"], ["world"], ["Hello ", "", ""], True),
        (["ab", "cX", "Y"], ["XY"], ["ab", "c", ""], True),
        (["wo", "rk done"], ["world"], ["", "work done"], False),  # a held prefix that did not match
        (["a\n", "\nb"], ["\n\n", "zz"], ["a", ""], True),
        (["plain"], ["zz"], ["plain"], False),
    ],
)
def test_stop_matcher_holds_back_only_what_may_start_a_stop(deltas, stops, released, matched):
    matcher = StopMatcher(stops)
    assert [matcher.push(d) for d in deltas] == released
    assert matcher.matched is matched
    assert all(s not in matcher.released for s in stops)


def test_cut_result_counts_up_to_the_stop_token():
    matcher = StopMatcher(["END"])
    for index, piece in enumerate(["a", "b", "E", "N", "D"]):
        event = TokenEvent(matcher.push(piece), index=index, session_bytes=100 + index)
        if matcher.matched:
            break
    worker = TurnResult("abENDxyz", "max_tokens", prompt_tokens=10, generated_tokens=8, context_tokens=17)
    cut = cut_result(worker, matcher, event)
    assert (cut.reply, cut.finish_reason, cut.generated_tokens) == ("ab", "stop", 5)
    assert cut.context_tokens == 14 and cut.kv_bytes == 104  # as if the turn had ended at the stop
    late = cut_result(TurnResult("x END y", "eos"), StopMatcher(["END"]), None)
    assert (late.reply, late.finish_reason) == ("x ", "stop")
    with pytest.raises(ValueError):
        check_stops(["a"] * 5)


def test_error_mapping_statuses():
    assert from_scheduler(InvalidArgument("x")).status == 400
    assert from_scheduler(Conflict("x")).status == 409
    assert from_scheduler(StoreUnavailable("x")).status == 503
    assert from_scheduler(ResourceExhausted("queue full")).status == 429
    assert from_scheduler(ResourceExhausted("could never run"), started=False).status == 400
    refused = from_scheduler(WorkerRefused("the conversation has 9000 tokens; the context limit is 8192"))
    assert (refused.status, refused.code) == (400, "context_length_exceeded")


def test_transcript_key_is_scoped_and_ignores_blank_messages():
    chat = [Message("user", "hi"), Message("assistant", "")]
    assert transcript_key("alice", "m", chat) == transcript_key("alice", "m", chat[:1])
    assert transcript_key("alice", "m", chat) != transcript_key("bob", "m", chat)
    assert transcript_key("alice", "m", chat) != transcript_key("alice", "other", chat)


def check_index(index) -> None:
    index.put("k1", "s1")
    assert index.get("k1") == "s1" and index.get("nope") is None
    index.discard("k1", "someone-else")
    assert index.get("k1") == "s1"
    index.discard("k1", "s1")
    assert index.get("k1") is None


def test_memory_index_is_bounded():
    index = MemoryPrefixIndex(max_entries=2)
    check_index(index)
    for key in ("a", "b", "c"):
        index.put(key, key)
    assert index.get("a") is None and index.get("c") == "c"


@pytest.mark.redis
def test_redis_index_with_the_store_retention():
    client = shared_redis_or_skip()
    prefix = unique_prefix()
    store = RedisStore("redis://127.0.0.1:6379/0", prefix=prefix, retention_s=60)
    try:
        index = RedisPrefixIndex(store)
        check_index(index)
        index.put("k2", "s2")
        assert 0 < client.ttl(f"{prefix}http:prefix:k2") <= 60
    finally:
        delete_prefix(client, prefix)
        store.close()


def test_http_port_in_use_or_equal_to_the_grpc_port_is_exit_2(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        used = str(busy.getsockname()[1])
        for extra in (["--http-port", used], ["--port", "50999", "--http-port", "50999"]):
            assert main(["scheduler", "--workers", "127.0.0.1:1", *extra]) == 2
            err = capsys.readouterr().err.strip()
            assert err.startswith("confkv: error:") and len(err.splitlines()) == 1, err
    with pytest.raises(SystemExit) as info:
        main(["scheduler", "--workers", "127.0.0.1:1", "--http-port", "70000"])
    assert info.value.code == 2


def test_core_stop_records_the_cut_reply_and_drops_the_worker_copy():
    """Transport-free: the scheduler core applies stops the same way for every front end."""
    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.core import Scheduler
    from scheduler_svc.store import MemoryStore
    from tests.helpers import GEOMETRY, FakeWorker

    worker = FakeWorker("w0:1", 10 * GEOMETRY.full_bytes(16))
    sched = Scheduler(MemoryStore(), [worker], SchedulerConfig(poll_interval_s=0.05))
    sched.start(background=False)
    sid = sched.create_session(policy="window:n=16").session_id
    events = list(sched.chat(sid, Message("user", "one two three four"), stop=["two"]))
    streamed = "".join(e.text for e in events if isinstance(e, TokenEvent))
    done = events[-1]
    assert streamed == done.result.reply == "echo1 four three "  # the reply was "echo1 four three two one"
    assert done.result.finish_reason == "stop" and done.result.generated_tokens == 4
    assert sched.store.get(sid).transcript[-1].content == streamed
    assert sid not in worker.sessions and sched.cluster.location(sid) is None  # the uncut copy is gone
    again = list(sched.chat(sid, Message("user", "five")))[-1]  # replays the recorded transcript
    assert again.result.finish_reason == "eos" and worker.sessions[sid]["transcript"][1].content == streamed
