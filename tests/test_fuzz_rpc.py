"""Fuzz every RPC's fields (hypothesis) against real in-process servers: a worker (tiny byte-level
Llama) and a scheduler in front of it, both with auth. Non-finite and subnormal floats, huge and
negative integers, odd strings, oversize payloads and undecodable bytes each get INVALID_ARGUMENT,
NOT_FOUND, RESOURCE_EXHAUSTED, PERMISSION_DENIED (or a normal answer), never UNKNOWN or INTERNAL;
the servers keep serving afterwards."""

from __future__ import annotations

import grpc
import pytest
from confkv_proto import scheduler_pb2 as pb
from confkv_proto import scheduler_pb2_grpc as pb_grpc
from confkv_proto import worker_pb2 as wpb
from confkv_proto import worker_pb2_grpc as wpb_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_svc.client import SchedulerClient
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core import Scheduler
from scheduler_svc.grpc_worker import GrpcWorkerClient
from scheduler_svc.server import start_scheduler
from scheduler_svc.store import MemoryStore
from tests.helpers import byte_llama
from worker_svc.codec import ByteChatCodec
from worker_svc.engine import Engine
from worker_svc.server import start_worker
from worker_svc.types import EngineConfig

CLIENT, WORKER = "fuzz-client", "fuzz-worker"


ALLOWED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,  # a turn already in flight in that session
    grpc.StatusCode.ALREADY_EXISTS,  # OpenSession of an id in use
}
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)

floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, 1e-38, 1e-45, -0.0, 0.01, 1.0, 10.0, 10.5, float("nan"), float("inf")]),
)
int32 = st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([0, 1, -1, 4096, 4097, 2**31 - 1]))
uint64 = st.integers(0, 2**64 - 1)
text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        ["", " ", "user", "system", "assistant", "tool", "\x00", "é" * 10, "x" * 32_001, "\ud7ff"]
    ),
)
request_ids = st.one_of(text, st.sampled_from(["same-id", "x" * 200, "\t", "é"]))
roles = st.one_of(st.sampled_from(["", "user", "system", "assistant", "tool", "robot"]), st.text(max_size=8))


@pytest.fixture(scope="module")
def servers():
    engine = Engine(
        byte_llama(),
        ByteChatCodec(),
        EngineConfig(
            kv_pool_bytes=400_000, prefill_chunk=16, default_max_new_tokens=4, max_context_tokens=512
        ),
    )
    worker = start_worker(engine, "tiny-bytes", port=0, auth_token=WORKER)
    workers = [GrpcWorkerClient(worker.address, token=WORKER)]
    config = SchedulerConfig(
        poll_interval_s=0.2, admission_timeout_s=2.0, default_policy="window:n=32", default_max_new_tokens=4
    )
    store = MemoryStore()
    scheduler = start_scheduler(Scheduler(store, workers, config), port=0, client_tokens={CLIENT: "fuzzer"})
    client = SchedulerClient(scheduler.address, CLIENT)
    sid = client.create_session("window:n=32").session_id
    wmd = (("authorization", f"Bearer {WORKER}"),)
    wchannel = grpc.insecure_channel(worker.address)
    wstub = wpb_grpc.WorkerStub(wchannel)
    wstub.OpenSession(wpb.OpenSessionRequest(session_id="fuzz-open", policy="window:n=32"), metadata=wmd)
    yield {
        "client": client,
        "sid": sid,
        "wstub": wstub,
        "wmd": wmd,
        "wchannel": wchannel,
        "worker": worker,
        "scheduler": scheduler,
        "store": store,
    }
    scheduler.stop(0.5)
    worker.stop(0.5)


def expect_ok_or_allowed(call) -> None:
    try:
        result = call()
        if hasattr(result, "__iter__") and not hasattr(result, "ListFields"):
            list(result)
    except grpc.RpcError as err:
        assert err.code() in ALLOWED, f"{err.code().name}: {err.details()}"


def still_serving(servers) -> None:
    client = servers["client"]
    sid = client.create_session("window:n=32").session_id  # the fuzzed session may be full by now
    done = client.turn(sid, "still serving?", max_new_tokens=2)[1]
    assert done.HasField("done")


def messages(data) -> list[wpb.ChatMessage]:
    return [wpb.ChatMessage(role=r, content=c) for r, c in data]


msgs = st.lists(st.tuples(roles, text), max_size=3)


@SETTINGS
@given(
    content=text,
    role=roles,
    max_new=int32,
    temperature=floats,
    seed=uint64,
    rid=request_ids,
    use_sid=st.booleans(),
)
def test_fuzz_scheduler_chat(servers, content, role, max_new, temperature, seed, rid, use_sid):
    c = servers["client"]
    request = pb.ChatRequest(
        session_id=servers["sid"] if use_sid else content[:200],
        content=content,
        role=role,
        max_new_tokens=max_new,
        temperature=temperature,
        seed=seed,
        request_id=rid,
    )
    expect_ok_or_allowed(lambda: c.stub.Chat(request, metadata=c.metadata, timeout=20))


@SETTINGS
@given(
    policy=text,
    model=text,
    data=msgs,
    rid=request_ids,
    sid=text,
    size=int32,
    token=text,
    include=st.booleans(),
)
def test_fuzz_scheduler_sessions(servers, policy, model, data, rid, sid, size, token, include):
    c, md = servers["client"], servers["client"].metadata
    create = pb.CreateSessionRequest(policy=policy, model=model, messages=messages(data), request_id=rid)
    expect_ok_or_allowed(lambda: c.stub.CreateSession(create, metadata=md, timeout=10))
    expect_ok_or_allowed(
        lambda: c.stub.GetSession(
            pb.GetSessionRequest(session_id=sid, include_transcript=include), metadata=md, timeout=10
        )
    )
    expect_ok_or_allowed(
        lambda: c.stub.ListSessions(
            pb.ListSessionsRequest(page_size=size, page_token=token), metadata=md, timeout=10
        )
    )
    expect_ok_or_allowed(
        lambda: c.stub.EndSession(pb.EndSessionRequest(session_id=sid + "x"), metadata=md, timeout=10)
    )
    expect_ok_or_allowed(lambda: c.stub.GetClusterStats(pb.ClusterStatsRequest(), metadata=md, timeout=10))


@SETTINGS
@given(
    sid=text,
    policy=text,
    data=msgs,
    max_new=int32,
    temperature=floats,
    seed=uint64,
    rid=request_ids,
    ctx=int32,
    interval=int32,
    release=st.booleans(),
)
def test_fuzz_worker_rpcs(
    servers, sid, policy, data, max_new, temperature, seed, rid, ctx, interval, release
):
    w, md = servers["wstub"], servers["wmd"]
    expect_ok_or_allowed(
        lambda: w.OpenSession(
            wpb.OpenSessionRequest(session_id=sid, policy=policy, transcript=messages(data)), metadata=md
        )
    )
    generate = wpb.GenerateRequest(
        session_id="fuzz-open",
        messages=messages(data),
        max_new_tokens=max_new,
        temperature=temperature,
        seed=seed,
        request_id=rid,
    )
    expect_ok_or_allowed(lambda: w.Generate(generate, metadata=md, timeout=20))
    estimate = wpb.EstimateBytesRequest(
        policy=policy, transcript=messages(data), context_tokens=ctx, max_new_tokens=max_new
    )
    expect_ok_or_allowed(lambda: w.EstimateBytes(estimate, metadata=md, timeout=10))
    expect_ok_or_allowed(
        lambda: w.DropSession(
            wpb.DropSessionRequest(session_id=sid, release_kv_only=release), metadata=md, timeout=10
        )
    )
    if interval < 0 or interval > 3_600_000:
        expect_ok_or_allowed(
            lambda: w.WatchFootprint(wpb.WatchFootprintRequest(interval_ms=interval), metadata=md, timeout=10)
        )
    expect_ok_or_allowed(lambda: w.Describe(wpb.DescribeRequest(), metadata=md, timeout=10))


@SETTINGS
@given(
    raw=st.one_of(
        st.binary(max_size=64), st.sampled_from([b"\x0a\x02\xff\xfe", b"\x12\x03\xc3\x28\x41", b"\xff" * 9])
    )
)
def test_fuzz_undecodable_bytes_are_invalid_argument(servers, raw):
    c = servers["client"]
    for channel, method, md in (
        (c.channel, "/confkv.v1.Scheduler/GetSession", c.metadata),
        (c.channel, "/confkv.v1.Scheduler/CreateSession", c.metadata),
        (servers["wchannel"], "/confkv.v1.Worker/OpenSession", servers["wmd"]),
        (servers["wchannel"], "/confkv.v1.Worker/EstimateBytes", servers["wmd"]),
    ):
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            call(raw, metadata=md, timeout=10)
        except grpc.RpcError as err:
            assert err.code() in ALLOWED, f"{method} {raw!r}: {err.code().name}: {err.details()}"
    chat = c.channel.unary_stream(
        "/confkv.v1.Scheduler/Chat", request_serializer=None, response_deserializer=None
    )
    try:
        list(chat(raw, metadata=c.metadata, timeout=10))
    except grpc.RpcError as err:
        assert err.code() in ALLOWED, f"Chat {raw!r}: {err.code().name}: {err.details()}"


def test_invalid_utf8_is_invalid_argument(servers):
    call = servers["client"].channel.unary_unary("/confkv.v1.Scheduler/GetSession")
    with pytest.raises(grpc.RpcError) as info:
        call(b"\x0a\x03\xc3\x28\x41", metadata=servers["client"].metadata, timeout=10)  # field 1: bad UTF-8
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_oversize_payload_is_resource_exhausted_and_auth_is_enforced(servers):
    c = servers["client"]
    huge = pb.CreateSessionRequest(messages=[wpb.ChatMessage(role="system", content="x" * 30_000)] * 700)
    with pytest.raises(grpc.RpcError) as info:
        c.stub.CreateSession(huge, metadata=c.metadata, timeout=30)
    assert info.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(grpc.RpcError) as info:
        servers["wstub"].Describe(wpb.DescribeRequest(), metadata=c.metadata, timeout=5)  # a client token
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    still_serving(servers)


class LostReply(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "the reply was lost on the way back"


class LoseFirstReply(grpc.UnaryUnaryClientInterceptor):
    """The server does the work, then the network loses its reply (once)."""

    def __init__(self) -> None:
        self.lost = 0

    def intercept_unary_unary(self, continuation, client_call_details, request):
        outcome = continuation(client_call_details, request)
        outcome.result()  # the server has answered: the session exists
        if self.lost == 0:
            self.lost += 1
            raise LostReply()
        return outcome


def test_a_create_whose_reply_was_lost_is_retried_into_one_session(servers):
    store, lossy = servers["store"], LoseFirstReply()
    client = SchedulerClient(servers["scheduler"].address, CLIENT)
    client.stub = pb_grpc.SchedulerStub(grpc.intercept_channel(client.channel, lossy))
    before = store.count()
    session = client.create_session("window:n=32", system="be brief", request_id="create-once")
    assert lossy.lost == 1 and store.count() == before + 1
    assert store.get(session.session_id).transcript[0].content == "be brief"
    again = client.create_session("window:n=32", system="be brief", request_id="create-once")
    assert again.session_id == session.session_id and store.count() == before + 1
    with pytest.raises(grpc.RpcError) as info:  # the id names that session: not another kind of session
        client.create_session("window:n=16", request_id="create-once")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    client.channel.close()


def test_servers_keep_serving_after_the_fuzz(servers):
    still_serving(servers)
    stub = pb_grpc.SchedulerStub(servers["client"].channel)
    assert (
        stub.GetClusterStats(pb.ClusterStatsRequest(), metadata=servers["client"].metadata).workers[0].healthy
    )


def test_sessions_command_is_scoped_to_the_caller(servers, monkeypatch, capsys):
    from confkv_serve.commands import main

    address = servers["scheduler"].address
    mine = servers["client"].create_session("window:n=32").session_id
    monkeypatch.setenv("CONFKV_AUTH_TOKEN", CLIENT)
    assert main(["sessions", "list", "--address", address, "--json"]) == 0
    assert mine in capsys.readouterr().out
    assert main(["sessions", "show", mine, "--address", address]) == 0
    assert main(["sessions", "show", f"--id={mine}", "--address", address]) == 0
    capsys.readouterr()
    # an id that begins with '-' (one in 64 did before ids were redrawn) reaches the scheduler
    assert main(["sessions", "show", "--id=-tjdJmbLMNwhDs6B3mSPDQ", "--address", address]) == 2
    assert "not_found" in capsys.readouterr().err
    assert main(["sessions", "show", mine, f"--id={mine}", "--address", address]) == 2  # given twice
    assert main(["sessions", "delete", mine, "--address", address]) == 0
    assert main(["sessions", "show", mine, "--address", address]) == 2  # gone: one line, exit 2
    assert "not_found" in capsys.readouterr().err
    assert main(["sessions", "show", "--address", address]) == 2  # usage error
    monkeypatch.setenv("CONFKV_AUTH_TOKEN", "someone-else")
    assert main(["sessions", "list", "--address", address]) == 1  # unauthenticated
