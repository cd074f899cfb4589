"""Integration on the embedded SmolLM2-135M-Instruct (Llama arch, GQA 9/3, RoPE)."""

from __future__ import annotations

import json

import pytest
import torch

from confkv.cache import ConfKVCache
from confkv.data import sample_text
from confkv.decode import generate, teacher_forced_logits
from tests.helpers import banded_mask, reference_logits

pytestmark = pytest.mark.smollm2
CORPUS = sample_text("persuasion")


@pytest.fixture(scope="module")
def prose_ids(smollm2):
    _, tok = smollm2
    try:
        text = open(CORPUS, encoding="utf-8").read()[5000:12000]
    except FileNotFoundError:
        text = (
            "It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 40
        )
    return tok(text, return_tensors="pt").input_ids[:, :300]


def test_full_reproduces_smollm2_logits_over_300_steps(smollm2, prose_ids):
    model, _ = smollm2
    ref = reference_logits(model, prose_ids)
    got = teacher_forced_logits(model, ConfKVCache.for_model(model, "full"), prose_ids)
    assert (got - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("spec, n, sinks", [("window:n=64", 64, 0), ("sinks:s=4,n=64", 64, 4)])
def test_smollm2_window_and_sinks_equal_banded_mask(smollm2, prose_ids, spec, n, sinks):
    model, _ = smollm2
    ids = prose_ids[:, :100]
    ref = reference_logits(model, ids, banded_mask(100, n, sinks))
    got = teacher_forced_logits(model, ConfKVCache.for_model(model, spec), ids)
    # fp32, 30 layers, logits of magnitude ~20: eager's masked softmax over 100 keys and our
    # softmax over the 64 kept keys sum in different orders (measured max diff ~1.5e-4).
    assert (got - ref).abs().max() <= 5e-4


def test_smollm2_confkv_int8_answers_and_stays_in_budget(smollm2):
    model, tok = smollm2
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    cache = ConfKVCache.for_model(model, "confkv:n_high=64,n_low=32,p=16,int8=1,w=16")
    with torch.no_grad():
        result = generate(model, cache, ids["input_ids"], 8, {tok.eos_token_id}, trace=True)
    assert "paris" in tok.decode(result.tokens).lower()
    assert max(max(row["tokens_per_layer"]) for row in result.trace) <= 64
    assert all(0.0 <= row["confidence"] <= 1.0 for row in result.trace)


@pytest.mark.smollm2
def test_bench_decode_interleaves_step_by_step(tmp_path):
    """``python -m confkv.bench_decode --block 1``: every policy and HF's path decode the same
    number of steps, in turns of one step, and the report names each with its tokens/s."""
    from confkv import bench_decode

    argv = ["--contexts", "96", "--steps", "4", "--repeats", "2", "--block", "1", "--out", str(tmp_path)]
    argv += ["--policies", "full;confkv:n_high=64,n_low=48,p=8", "--name", "t"]
    assert bench_decode.main(argv) == 0
    report = json.loads((tmp_path / "t.json").read_text())
    row = report["results"]["96"]
    assert set(row) == {"hf-sdpa", "full", "confkv:n_high=64,n_low=48,p=8"}
    assert all(len(v["runs"]) == 2 and v["tokens_per_s"] > 0 for v in row.values())
    for v in row.values():  # the whole-run rate: 8 steps over their summed time, between the repeats'
        runs = v["runs"]
        assert v["tokens_per_s_total"] == pytest.approx(8 / sum(4 / r for r in runs))
        assert min(runs) * (1 - 1e-9) <= v["tokens_per_s_total"] <= max(runs) * (1 + 1e-9)
    assert "--block 1" in report["command"]
    with pytest.raises(SystemExit):
        bench_decode.main(["--block", "-1"])
