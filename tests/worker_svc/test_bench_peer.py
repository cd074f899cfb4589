"""``python -m worker_svc.bench --peer hf`` on a tiny model: the systems it runs, the engine's
decode-step medians and the ratios against engine ``full`` in the report."""

from __future__ import annotations

import argparse

import torch

from tests.helpers import byte_llama
from worker_svc import bench, bench_lockstep
from worker_svc.codec import ByteChatCodec
from worker_svc.engine import Engine
from worker_svc.types import EngineConfig


def test_peer_workload_reports_steps_and_the_variants_it_was_asked_for():
    torch.set_num_threads(1)
    model = byte_llama(seed=1)
    args = argparse.Namespace(
        corpus=bench.CORPUS,
        prefill_chunk=16,
        repeats=1,
        no_cb=True,
        plain_linears=False,
        evict_per_sequence=True,
        lockstep=True,
    )
    workload = bench.Workload("tiny", 3, 80, 6, ("full", "h2o:n=24,recent=6"))
    report = bench.peer_workload(model, ByteChatCodec(), workload, args, pad_id=0)
    systems = report["systems"]
    assert set(systems) == {
        "hf_generate",
        "engine full",
        "engine h2o:n=24,recent=6",
        "engine h2o:n=24,recent=6 (per-sequence eviction)",  # only evicting policies get the variant
    }
    assert systems["hf_generate"]["step_ms_median"] is None  # transformers reports no steps
    for name in (
        "engine full",
        "engine h2o:n=24,recent=6",
        "engine h2o:n=24,recent=6 (per-sequence eviction)",
    ):
        out = systems[name]
        assert out["generated_tokens"] == 3 * 6
        assert out["step_ms_median"] > 0
        assert (
            out["vs_engine_full"]
            == out["tokens_per_s_median"] / systems["engine full"]["tokens_per_s_median"]
        )
    assert systems["engine full"]["vs_engine_full"] == 1.0
    text = bench.peer_markdown(
        {
            "model": "tiny", "threads": 1, "prefill_chunk": 16, "transformers": "x", "torch": "y",
            "repeats": 1, "loadavg_start": [0], "loadavg_end": [0], "command": "c",
            "workloads": [report], "ttft": {},
        }
    )  # fmt: skip
    assert "(per-sequence eviction)" in text and "vs engine `full`" in text
    lock = report["lockstep"]
    assert set(lock) == set(systems) - {"hf_generate"}
    assert lock["engine full"]["speed_vs_engine_full_runs"] == [1.0]
    for r in lock.values():
        assert r["steps_per_run"] > 0 and r["step_ms_median"] > 0 and r["speed_vs_engine_full_median"] > 0
    assert "Engines in lockstep" in text


def test_lockstep_takes_turns_one_engine_step_each():
    """Round robin, one engine step per turn (a finished system leaves the round); every system
    reports its full-batch decode steps."""
    torch.set_num_threads(1)
    model = byte_llama(seed=2)
    order: list[str] = []

    class Logged(Engine):
        def step(self) -> bool:
            order.append(self.config.worker_id)
            return super().step()

    def engine(name: str) -> Engine:
        return Logged(
            model, ByteChatCodec(), EngineConfig(kv_pool_bytes=1 << 30, prefill_chunk=16, worker_id=name)
        )

    texts = ["The weather in Bath", "Tell me about the sea, its tides and its moods"]
    systems = [
        bench_lockstep.System("a", engine("a"), "full"),
        bench_lockstep.System("b", engine("b"), "h2o:n=24,recent=6"),
        bench_lockstep.System("c", engine("c"), "window:n=20"),
    ]
    steps = bench_lockstep.lockstep(systems, texts, 10, "t")
    assert all(len(steps[n]) >= 2 for n in "abc")
    while order and order[-1] != "a":  # the tail: systems leave the round as they finish
        order.pop()
    head = order[: 3 * (len(order) // 3)]
    assert head == ["a", "b", "c"] * (len(head) // 3)
    ratios = bench_lockstep.ratios(steps, "a")
    assert ratios["a"]["speed_vs_reference"] == 1.0
