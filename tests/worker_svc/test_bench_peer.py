"""``python -m worker_svc.bench --peer hf`` on a tiny model: the systems it runs, the engine's
decode-step medians and the ratios against engine ``full`` in the report."""

from __future__ import annotations

import argparse

import torch

from tests.helpers import byte_llama
from worker_svc import bench
from worker_svc.codec import ByteChatCodec


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
