"""The capacity experiment's machinery on a tiny model: the scheduler + worker stack over gRPC,
the per-step recorder, and the concurrency verdict (served together vs queued, nothing lost)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from confkv.attention import enable
from confkv.memory import KVGeometry
from loadtest.capacity import StepRecorder, run_level, start_services
from loadtest.conversations import ConversationConfig
from worker_svc.codec import ByteChatCodec

MAX_CONTEXT = 512
SMALL = "confkv:n_high=48,n_low=24,p=8,s=2,int8=1,w=16"


@pytest.fixture(scope="module")
def stack():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=ByteChatCodec.vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=MAX_CONTEXT)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    enable(model)
    geometry = KVGeometry.from_config(model.config, torch.float32)
    pool = 2 * geometry.full_bytes(MAX_CONTEXT)  # room for two `full` sessions
    engine, worker, server = start_services(model, ByteChatCodec(), "tiny", pool, MAX_CONTEXT, 8, 120.0)
    recorder = StepRecorder(engine)
    yield server.address, recorder
    server.stop(0.5)
    worker.stop(0.5)


CONV = ConversationConfig(page_chars=120, turns=2)


def test_full_serves_two_together_and_queues_the_third_without_loss(stack):
    address, recorder = stack
    two = run_level(address, recorder, "full", 2, CONV, max_new=3, seed=0)
    assert two["served_concurrently"] and two["max_resident"] == 2 and two["failed"] == 0
    three = run_level(address, recorder, "full", 3, CONV, max_new=3, seed=10)
    assert not three["served_concurrently"]
    assert three["failed"] == 0 and three["turns"] == 6  # over capacity: it waits, nothing is lost
    # at most two turns run at once (queued notices); an idle session may keep its KV beside them
    # (turns reserve only their own context, and the worker frees idle KV under pressure)
    assert three["queued_notices"] > 0 and three["max_resident"] >= 2
    assert three["steps_over_capacity"] == 0 and three["max_used_bytes"] <= three["capacity_bytes"]


def test_bounded_policy_serves_more_in_the_same_pool(stack):
    address, recorder = stack
    row = run_level(address, recorder, SMALL, 6, CONV, max_new=3, seed=20)
    assert row["served_concurrently"] and row["max_resident"] == 6 and row["max_batch"] >= 2
    assert row["turns"] == 12 and row["tokens"] > 0 and row["ttft_ms_p95"] >= row["ttft_ms_p50"] > 0


def test_recall_sessions_report_host_memory_within_the_host_pool(stack):
    """recall=1: the same hot bound, plus cold tiers in host memory that the recorder measures
    exactly per step and that never exceed the worker's host pool."""
    address, recorder = stack
    engine, config = recorder.engine, recorder.engine.config
    engine.config = dataclasses.replace(config, host_pool_bytes=4 << 20)  # as --host-pool-bytes 4MiB
    engine.host_pool.capacity_bytes = 4 << 20
    try:
        row = run_level(address, recorder, SMALL + ",recall=1,page=8", 3, CONV, max_new=3, seed=30)
    finally:
        engine.config, engine.host_pool.capacity_bytes = config, 1 << 62
    assert row["failed"] == 0 and row["turns"] == 6
    assert 0 < row["max_host_used_bytes"] <= 4 << 20 and row["steps_over_host_capacity"] == 0
