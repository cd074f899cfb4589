"""End to end on loopback: real ``confkv worker`` processes (tiny random Llama), a real
``confkv scheduler`` process on the shared Redis (own key prefix), a shared-secret token on
every hop. Worker killed mid-session, scheduler restart, Redis briefly unreachable, admission
queueing, bad input on every RPC."""

from __future__ import annotations

import os
import signal
import threading

import grpc
import pytest
from confkv_proto import scheduler_pb2 as pb

from scheduler_svc.app import serve_scheduler
from scheduler_svc.client import SchedulerClient
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.store_redis import RedisStore
from tests.helpers import (
    TOKEN,
    WORKER_TOKEN,
    PrivateRedis,
    Proc,
    delete_prefix,
    free_port,
    save_tiny_model,
    shared_redis_or_skip,
    unique_prefix,
)

pytestmark = pytest.mark.redis
POLICY = "window:n=64"  # 64 tokens * 2 layers * 256 B = 32 KiB reserved per session
POOL = 40_000  # each worker holds exactly one such session
REDIS = "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("sched-e2e")


@pytest.fixture(scope="module")
def workers(workdir):
    model = save_tiny_model(workdir / "tiny-llama")
    procs = {}
    for name in ("a", "b"):
        port = free_port()
        args = ["worker", "--model", str(model), "--port", str(port), "--kv-pool-bytes", str(POOL)]
        args += ["--max-new-tokens", "6", "--log-format", "text", "--prefill-chunk", "32"]
        procs[f"127.0.0.1:{port}"] = Proc(args, workdir / f"worker-{name}.log").start()
    for address, proc in procs.items():
        proc.wait_serving(int(address.rsplit(":", 1)[1]))
    yield procs
    for proc in procs.values():
        proc.kill(signal.SIGTERM)


@pytest.fixture
def prefix():
    client = shared_redis_or_skip()
    value = unique_prefix()
    yield value
    delete_prefix(client, value)


def start_scheduler(workdir, workers, prefix, port=None) -> tuple[Proc, SchedulerClient]:
    port = port or free_port()
    args = ["scheduler", "--port", str(port), "--redis", REDIS, "--redis-prefix", prefix]
    args += [
        "--workers",
        ",".join(workers),
        "--queue-limit",
        "1",
        "--admission-timeout",
        "60",
        "--max-new-tokens",
        "6",
    ]
    proc = Proc(args, workdir / f"scheduler-{port}.log").start()
    proc.wait_serving(port)
    return proc, SchedulerClient(f"127.0.0.1:{port}", TOKEN)


def transcript(client, session_id):
    return [(m.role, m.content) for m in client.get_session(session_id).transcript]


def test_worker_killed_mid_session_and_scheduler_restart(workdir, workers, prefix):
    proc, client = start_scheduler(workdir, workers, prefix)
    session = client.create_session(POLICY)
    acknowledged = []
    for text in ("hello", "tell me more"):
        reply, done = client.turn(session.session_id, text)
        assert reply == done.done.text and done.turn == len(acknowledged) // 2 + 1
        acknowledged += [("user", text), ("assistant", reply)]
    first_worker = done.worker
    workers[first_worker].kill()  # SIGKILL: the session's KV is gone with it
    reply, done = client.turn(session.session_id, "are you still there")
    acknowledged += [("user", "are you still there"), ("assistant", reply)]
    assert done.turn == 3 and done.worker != first_worker
    assert transcript(client, session.session_id) == acknowledged  # no acknowledged turn lost
    stats = client.stats()
    assert {w.address: w.healthy for w in stats.workers}[first_worker] is False
    workers[first_worker].start()  # back for later tests

    port = int(client.address.rsplit(":", 1)[1])
    proc.kill()  # abrupt scheduler death; sessions live on in Redis
    client.close()
    proc, client = start_scheduler(workdir, workers, prefix, port=port)
    view = client.get_session(session.session_id)
    # Redis is the truth: the restarted scheduler dropped the workers' copies; the next turn replays
    assert view.turns == 3 and view.worker == "" and view.state == "released"
    reply, done = client.turn(session.session_id, "after the restart")
    assert done.turn == 4
    assert transcript(client, session.session_id) == acknowledged + [
        ("user", "after the restart"),
        ("assistant", reply),
    ]
    client.end_session(session.session_id)
    proc.kill(signal.SIGTERM)
    workers[first_worker].wait_serving(int(first_worker.rsplit(":", 1)[1]))


def test_admission_queues_when_the_pool_is_full(workdir, workers, prefix):
    proc, client = start_scheduler(workdir, workers, prefix)
    try:
        sessions = [client.create_session(POLICY).session_id for _ in range(4)]
        # two long turns running: one per worker, both pools reserved (idle sessions reserve nothing)
        running = [client.chat(s, "fill with a long answer", max_new_tokens=400) for s in sessions[:2]]
        for stream in running:
            next(stream)
        waiting = client.chat(sessions[2], "wait for room")
        first = next(waiting)
        assert first.HasField("queued") and first.queued.position == 1
        events = []
        thread = threading.Thread(target=lambda: events.extend(waiting))
        thread.start()
        with pytest.raises(grpc.RpcError) as refused:
            client.turn(sessions[3], "no room")
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in refused.value.details()
        running[0].cancel()  # frees one worker: the queued turn goes there
        thread.join(60)
        assert events and events[-1].HasField("done") and events[-1].turn == 1
        for w in client.stats().workers:
            assert w.footprint.used_bytes <= w.footprint.capacity_bytes == POOL
        running[1].cancel()
        for s in sessions:
            client.end_session(s)
    finally:
        client.close()
        proc.kill(signal.SIGTERM)


def expect(code, call, *args, match=""):
    with pytest.raises(grpc.RpcError) as err:
        result = call(*args)
        if hasattr(result, "__iter__") and not isinstance(result, pb.Session):
            list(result)
    assert err.value.code() == code, err.value.details()
    assert match in err.value.details()


def test_bad_input_on_every_rpc(workdir, workers, prefix):
    proc, client = start_scheduler(workdir, workers, prefix)
    try:
        stub, md = client.stub, client.metadata
        bad, missing = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
        expect(bad, client.create_session, "nope:n=1", match="unknown policy")
        expect(bad, client.create_session, "window:n=0")
        expect(bad, client.create_session, POLICY, "no-such-model", match="no worker serves")
        request = pb.CreateSessionRequest(messages=[{"role": "robot", "content": "x"}])
        expect(bad, lambda: stub.CreateSession(request, metadata=md), match="role")
        sid = client.create_session(POLICY).session_id
        expect(bad, client.chat, sid, "", match="empty")
        expect(bad, client.chat, sid, "x" * 40_000, match="exceeds the limit")
        expect(bad, client.chat, sid, "hi", -1, match="max_new_tokens")
        expect(bad, client.chat, "", "hi", match="session id")
        expect(missing, client.chat, "no-such-session", "hi")
        expect(
            bad, lambda: stub.Chat(pb.ChatRequest(session_id=sid, content="hi", role="system"), metadata=md)
        )
        expect(bad, client.get_session, "")
        expect(missing, client.get_session, "no-such-session")
        expect(bad, client.list_sessions, -1)
        expect(bad, client.list_sessions, 10, "not-a-number", match="page_token")
        expect(missing, client.end_session, "no-such-session")
        # without the token nothing but health answers
        anonymous = SchedulerClient(client.address)
        expect(grpc.StatusCode.UNAUTHENTICATED, anonymous.stats)
        expect(grpc.StatusCode.UNAUTHENTICATED, anonymous.chat, sid, "hi")
        anonymous.close()
        # and the scheduler still serves
        assert client.turn(sid, "still fine")[1].turn == 1
        assert any(s.session_id == sid for s in client.list_sessions(10).sessions)
        client.end_session(sid)
        assert all(w.healthy for w in client.stats().workers)
    finally:
        client.close()
        proc.kill(signal.SIGTERM)


def test_redis_briefly_unreachable_then_recovers(workers):
    redis_server = PrivateRedis()
    redis_server.start()
    store = RedisStore(redis_server.url, prefix="e2e:", timeout_s=1.0)
    config = SchedulerConfig(poll_interval_s=0.2, admission_timeout_s=30, default_max_new_tokens=6)
    server = serve_scheduler(
        list(workers), store, config, client_tokens={TOKEN: "e2e"}, worker_token=WORKER_TOKEN
    )
    client = SchedulerClient(server.address, TOKEN)
    try:
        sid = client.create_session(POLICY).session_id
        first, _ = client.turn(sid, "before the outage")
        os.kill(redis_server.proc.pid, signal.SIGSTOP)  # Redis hangs: every call times out
        try:
            for call in (
                lambda: client.turn(sid, "during the outage"),
                lambda: client.create_session(POLICY),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "session store unavailable" in err.value.details()
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        second, done = client.turn(sid, "after the outage")
        assert done.turn == 2
        assert transcript(client, sid) == [
            ("user", "before the outage"),
            ("assistant", first),
            ("user", "after the outage"),
            ("assistant", second),
        ]
        client.end_session(sid)
    finally:
        client.close()
        server.stop(1.0)
        store.close()
        redis_server.stop()
