"""Cold tiers in placement, through a real worker on loopback: the worker's host pool reaches the
scheduler in its footprint, a recall=1 session whose cold tier could never fit is refused at
creation, a bounded one runs, and its host reservation is given back when the turn ends."""

from __future__ import annotations

import pytest
import torch

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core import Scheduler
from scheduler_svc.domain import Message, TurnDone
from scheduler_svc.errors import ResourceExhausted
from scheduler_svc.grpc_worker import GrpcWorkerClient
from scheduler_svc.store import MemoryStore
from tests.helpers import HTTP_MODEL, byte_llama
from worker_svc.codec import ByteChatCodec
from worker_svc.engine import Engine
from worker_svc.server import start_worker
from worker_svc.types import EngineConfig

HOST_POOL = 200_000


@pytest.fixture(scope="module")
def live():
    torch.set_num_threads(1)
    config = EngineConfig(
        kv_pool_bytes=8 << 20, host_pool_bytes=HOST_POOL, prefill_chunk=64, max_context_tokens=2048
    )
    engine = Engine(byte_llama(), ByteChatCodec(), config)
    worker = start_worker(engine, HTTP_MODEL, port=0)
    client = GrpcWorkerClient(worker.address)
    sched = Scheduler(
        MemoryStore(), [client], SchedulerConfig(default_max_new_tokens=4, poll_interval_s=0.05)
    )
    sched.start(background=False)
    yield sched, engine, client
    sched.stop()
    worker.stop(0)


def test_host_pool_reaches_placement_and_bounds_recall_sessions(live):
    sched, engine, client = live
    report = client.report()
    assert report.host_capacity_bytes == HOST_POOL and report.host_used_bytes == 0
    # every token of 2048 in INT8 in every layer would not fit the worker's host pool
    with pytest.raises(ResourceExhausted, match="host pool"):
        sched.create_session(policy="confkv:n_high=64,n_low=48,p=8,s=2,recall=1")
    bounded = "confkv:n_high=64,n_low=48,p=8,s=2,recall=1,page=8,cold_bytes=100000"
    session = sched.create_session(policy=bounded)
    events = list(sched.chat(session.session_id, Message("user", "Remember 4817. " * 12)))
    assert isinstance(events[-1], TurnDone)
    cold = engine.session_report(session.session_id).cold_bytes
    assert 0 < cold <= 100_000
    report = client.report()
    assert report.host_used_bytes == cold and report.session_cold_bytes == {session.session_id: cold}
    sched.tick()  # a fresh footprint: the idle session's cold bytes are ours, not external
    slot = sched.cluster.placer.workers[client.address]
    assert slot.host_reservations == {} and slot.host_committed_bytes == 0
    sched.end_session(session.session_id)
