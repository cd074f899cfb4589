"""The Worker wire contract on 127.0.0.1: streaming turns, cancel, footprints and error codes.

Most tests run the real server around a tiny byte-level model; the ``smollm2`` ones use the
embedded default model for a real multi-turn conversation.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from confkv_proto import worker_pb2 as pb
from confkv_proto import worker_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from confkv.limits import MAX_MESSAGE_CHARS
from worker_svc.server import start_worker

USER = "user"


def msg(text: str, role: str = USER) -> pb.ChatMessage:
    return pb.ChatMessage(role=role, content=text)


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def generate(stub, session_id: str, text: str, max_new_tokens: int = 0) -> list[pb.GenerateEvent]:
    request = pb.GenerateRequest(session_id=session_id, messages=[msg(text)], max_new_tokens=max_new_tokens)
    return list(stub.Generate(request))


def check_errors_and_still_serving(stub, policy: str, max_chars: int) -> None:
    stub.OpenSession(pb.OpenSessionRequest(session_id="ok", policy=policy))
    stub.OpenSession(pb.OpenSessionRequest(session_id="big", policy="full"))
    invalid, exhausted = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
    cases = [
        (lambda: stub.OpenSession(pb.OpenSessionRequest(session_id="p", policy="confkv:n_high=x")), invalid),
        (lambda: stub.OpenSession(pb.OpenSessionRequest(session_id="p", policy="nosuch")), invalid),
        (lambda: stub.OpenSession(pb.OpenSessionRequest(session_id="ok")), grpc.StatusCode.ALREADY_EXISTS),
        (lambda: generate(stub, "ok", ""), invalid),
        (lambda: generate(stub, "ok", "x" * (max_chars + 1)), invalid),
        (lambda: generate(stub, "ok", "hi", max_new_tokens=-1), invalid),
        (lambda: generate(stub, "ghost", "hi"), grpc.StatusCode.NOT_FOUND),
        (lambda: stub.DropSession(pb.DropSessionRequest(session_id="ghost")), grpc.StatusCode.NOT_FOUND),
        (lambda: generate(stub, "big", "hi", max_new_tokens=4000), exhausted),  # worst case > the pool
    ]
    for call, code in cases:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == code, info.value.details()
        assert info.value.details()
    events = generate(stub, "ok", "still there?", max_new_tokens=3)
    assert events[-1].WhichOneof("event") == "done"
    for session_id in ("ok", "big"):
        stub.DropSession(pb.DropSessionRequest(session_id=session_id))


@pytest.fixture
def tiny_worker(make_engine):
    engine = make_engine(kv_pool_bytes=400_000, max_new_tokens_limit=4096)
    worker = start_worker(engine, "tiny-bytes", port=0)
    channel = grpc.insecure_channel(worker.address)
    yield worker, pb_grpc.WorkerStub(channel), channel
    channel.close()
    worker.stop(grace=1.0)


def test_tiny_stream_footprint_and_health(tiny_worker):
    worker, stub, channel = tiny_worker
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="confkv.v1.Worker")).status == 1
    info = stub.Describe(pb.DescribeRequest())
    assert info.kv_pool_bytes == 400_000 and info.num_layers == 2
    stub.OpenSession(pb.OpenSessionRequest(session_id="a", policy="full", transcript=[msg("hi")]))
    events = list(
        stub.Generate(pb.GenerateRequest(session_id="a", messages=[msg("go on")], max_new_tokens=6))
    )
    done = events[-1].done
    assert done.reason in (pb.FINISH_REASON_EOS, pb.FINISH_REASON_MAX_TOKENS)
    assert [e.token.index for e in events[:-1]] == list(range(len(events) - 1))
    fp = stub.GetFootprint(pb.FootprintRequest(include_sessions=True))
    assert fp.used_bytes == fp.sessions[0].kv_bytes == worker.engine.sessions["a"].seq.nbytes() > 0
    assert fp.capacity_bytes == 400_000 and fp.sessions[0].turns == 3
    watch = stub.WatchFootprint(pb.WatchFootprintRequest(interval_ms=20))
    reports = [next(watch) for _ in range(3)]
    watch.cancel()
    assert all(r.used_bytes == fp.used_bytes for r in reports)
    est = stub.EstimateBytes(pb.EstimateBytesRequest(policy="full", context_tokens=100, max_new_tokens=10))
    assert est.worst_case_bytes == worker.engine.geometry.full_bytes(110) and est.policy_bound_bytes == 0


def test_tiny_bad_input_codes_and_worker_keeps_serving(tiny_worker):
    _, stub, _ = tiny_worker
    check_errors_and_still_serving(stub, "confkv:n_high=32,n_low=16,p=4,s=2", MAX_MESSAGE_CHARS)


def test_tiny_cancel_mid_stream_frees_memory(tiny_worker):
    worker, stub, _ = tiny_worker
    stub.OpenSession(pb.OpenSessionRequest(session_id="c", policy="window:n=64"))
    call = stub.Generate(
        pb.GenerateRequest(session_id="c", messages=[msg("talk a lot")], max_new_tokens=3000)
    )
    for _ in range(3):
        assert next(call).WhichOneof("event") == "token"
    assert stub.GetFootprint(pb.FootprintRequest()).used_bytes > 0
    call.cancel()
    wait_for(lambda: stub.GetFootprint(pb.FootprintRequest()).active_sessions == 0)
    fp = stub.GetFootprint(pb.FootprintRequest(include_sessions=True))
    assert fp.used_bytes == fp.reserved_bytes == 0 and fp.sessions[0].turns == 0


def test_auth_token_is_required_when_configured(make_engine):
    worker = start_worker(make_engine(), "tiny-bytes", port=0, auth_token="s3cret")
    try:
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.WorkerStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.Describe(pb.DescribeRequest())
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert stub.Describe(
                pb.DescribeRequest(), metadata=[("authorization", "Bearer s3cret")]
            ).num_layers
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest()).status == 1
    finally:
        worker.stop(grace=0.5)


# -- SmolLM2 (the real default model) -------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_worker():
    from worker_svc.app import create_engine

    engine = create_engine("smollm2", kv_pool_bytes=64 << 20, prefill_chunk=128)
    worker = start_worker(engine, "smollm2", port=0)
    channel = grpc.insecure_channel(worker.address)
    yield worker, pb_grpc.WorkerStub(channel)
    channel.close()
    worker.stop(grace=1.0)


@pytest.mark.smollm2
def test_smollm2_streamed_multi_turn_conversation(smol_worker):
    _, stub = smol_worker
    stub.OpenSession(
        pb.OpenSessionRequest(session_id="chat", policy="confkv:n_high=96,n_low=48,p=16,int8=1,w=32",
                              transcript=[msg("You are a helpful assistant. Answer briefly.", "system")])
    )  # fmt: skip
    replies = []
    for question in ("What is the capital of France?", "And of Italy?"):
        events = generate(stub, "chat", question, max_new_tokens=12)
        tokens, done = [e.token for e in events[:-1]], events[-1].done
        assert tokens and "".join(t.text for t in tokens).strip() == done.text.strip()
        replies.append(done)
    assert "Paris" in replies[0].text
    assert replies[1].prompt_tokens < replies[1].context_tokens  # second turn fed only its suffix
    fp = stub.GetFootprint(pb.FootprintRequest(include_sessions=True))
    session = fp.sessions[0]
    assert session.turns == 5 and 0 < session.kv_bytes == fp.used_bytes <= session.peak_bytes
    stub.DropSession(pb.DropSessionRequest(session_id="chat"))


@pytest.mark.smollm2
def test_smollm2_cancel_mid_stream_frees_memory(smol_worker):
    _, stub = smol_worker
    stub.OpenSession(pb.OpenSessionRequest(session_id="cancel", policy="full"))
    story = msg("Write a long story about a cat.")
    call = stub.Generate(pb.GenerateRequest(session_id="cancel", messages=[story], max_new_tokens=200))
    next(call), next(call)
    assert stub.GetFootprint(pb.FootprintRequest()).used_bytes > 0
    call.cancel()
    wait_for(lambda: stub.GetFootprint(pb.FootprintRequest()).active_sessions == 0)
    fp = stub.GetFootprint(pb.FootprintRequest(include_sessions=True))
    assert fp.used_bytes == 0 and fp.sessions[0].kv_bytes == 0 and fp.sessions[0].turns == 0
    stub.DropSession(pb.DropSessionRequest(session_id="cancel"))


@pytest.mark.smollm2
def test_smollm2_bad_input_codes_and_worker_keeps_serving(smol_worker):
    _, stub = smol_worker
    check_errors_and_still_serving(stub, "window:n=64", MAX_MESSAGE_CHARS)


def test_graceful_stop_finishes_or_cancels_in_flight_streams(make_engine):
    worker = start_worker(make_engine(), "tiny-bytes", port=0)
    with grpc.insecure_channel(worker.address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        stub.OpenSession(pb.OpenSessionRequest(session_id="s", policy="window:n=32"))
        request = pb.GenerateRequest(session_id="s", messages=[msg("keep talking")], max_new_tokens=1000)
        call = stub.Generate(request)
        assert next(call).WhichOneof("event") == "token"
        stopper = threading.Thread(target=worker.stop, kwargs={"grace": 0.0})
        stopper.start()
        events = list(call)  # the stream ends cleanly with a done event, not an error
        stopper.join()
    assert events[-1].done.reason in (pb.FINISH_REASON_SHUTDOWN, pb.FINISH_REASON_EOS)
