"""The demotion benchmark's three conditions on a tiny engine: kept and demoted resume by feeding
only the question, released re-reads the conversation; demotion empties the hot cache but for
sinks and the recent window, into the cold tier."""

from __future__ import annotations

import torch

from tests.helpers import printable_byte_llama
from worker_svc.bench_demote import CONDITIONS, markdown, run_item, summarize
from worker_svc.codec import ByteChatCodec
from worker_svc.engine import Engine
from worker_svc.types import EngineConfig

POLICY = "confkv:n_high=40,n_low=32,p=4,s=2,recall=1,page=32"  # a cold tier that never reaches its bound
ITEM = {
    "id": "tiny",
    "answer": "4817",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "The passkey is 4817. " * 4},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "Talk about the weather in Bath for a while. " * 3},
        {"role": "assistant", "content": "It rains."},
        {"role": "user", "content": "What is the passkey?"},
    ],
}


def test_conditions_feed_what_they_should():
    torch.set_num_threads(1)
    engine = Engine(
        printable_byte_llama(), ByteChatCodec(), EngineConfig(kv_pool_bytes=1 << 30, prefill_chunk=16)
    )
    row = run_item(engine, ITEM, POLICY, max_new=4)
    kept, demoted, released = (row[c] for c in CONDITIONS)
    assert kept["prompt_tokens"] == demoted["prompt_tokens"] < released["prompt_tokens"]
    assert (
        demoted["idle_hot_bytes"] < kept["idle_hot_bytes"]
        and demoted["idle_cold_bytes"] > kept["idle_cold_bytes"]
    )
    assert released["idle_hot_bytes"] == released["idle_cold_bytes"] == 0
    assert engine.sessions == {}  # every condition's session was dropped
    summary = summarize([row])
    assert summary["kept"]["same_as_kept"] == 1
    assert "| demoted |" in markdown({"items": [row], "summary": summary, "command": "x", "policy": POLICY,
                                      "model": "tiny", "max_new_tokens": 4})  # fmt: skip
