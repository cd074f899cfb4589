"""End to end: SmolLM2 teacher-forced logits through the Triton kernels (the interpreter on a CPU)
equal the PyTorch reference path, with eviction, INT8 demotion and a prefill chunk involved."""

from __future__ import annotations

import pytest
import torch
from confkv_kernels import dispatch

from confkv.cache import ConfKVCache
from confkv.decode import teacher_forced_logits

pytestmark = pytest.mark.smollm2
triton = pytest.importorskip("triton")
SPEC = "confkv:n_high=24,n_low=20,p=4,s=2,int8=1,w=8"


def test_smollm2_logits_triton_path_equals_reference(smollm2, monkeypatch):
    model, tok = smollm2
    ids = tok(
        "It is a truth universally acknowledged, that a single man in possession of a good "
        "fortune, must be in want of a wife. However little known",
        return_tensors="pt",
    ).input_ids[:, :30]
    runs = {}
    for backend in (dispatch.Backend.REFERENCE, dispatch.Backend.TRITON):
        monkeypatch.setattr(dispatch, "_FORCED", backend)
        cache = ConfKVCache.for_model(model, SPEC)
        runs[backend] = (teacher_forced_logits(model, cache, ids, prefix=12), cache.seqs[0])
    (ref, ref_seq), (tri, tri_seq) = runs[dispatch.Backend.REFERENCE], runs[dispatch.Backend.TRITON]
    assert ref_seq.stats.evicted_tokens > 0 and ref_seq.stores[0].q.n > 0  # eviction and INT8 happened
    assert (tri - ref).abs().max() <= 2e-3
    assert torch.equal(tri.argmax(-1), ref.argmax(-1))
    assert tri_seq.tokens_per_layer() == ref_seq.tokens_per_layer()
