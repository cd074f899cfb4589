"""The padded one-call decode attention equals the per-sequence reference (CPU path)."""

from __future__ import annotations

import pytest
import torch
from confkv_kernels import reference

from confkv.batched import padded_decode_attention, workspace


def _storage(hkv: int, n8: int, nf: int, d: int, dtype, gen: torch.Generator):
    k8, k8s = reference.quantize_int8_ref(torch.randn(hkv, n8, d, generator=gen))
    v8, v8s = reference.quantize_int8_ref(torch.randn(hkv, n8, d, generator=gen))
    kf = torch.randn(hkv, nf, d, generator=gen).to(dtype)
    vf = torch.randn(hkv, nf, d, generator=gen).to(dtype)
    return k8, k8s, v8, v8s, kf, vf


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "shapes", [[(0, 5), (0, 17), (0, 1)], [(12, 3), (0, 9), (30, 0), (1, 1)], [(4, 4)] * 3]
)
def test_padded_decode_equals_each_sequence_alone(dtype, shapes):
    gen = torch.Generator().manual_seed(len(shapes))
    hkv, groups, d = 2, 3, 16
    views = [_storage(hkv, n8, nf, d, dtype, gen) for n8, nf in shapes]
    q = torch.randn(len(shapes), hkv * groups, d, generator=gen).to(dtype)
    for buffer in (workspace().k, workspace().v):
        buffer.fill_(float("nan"))  # stale values from an earlier call must not leak into the output
    out, masses = padded_decode_attention(q, views, 0.25)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for b, view in enumerate(views):
        ref_out, ref8, reff = reference.decode_attention_ref(
            q[b : b + 1],
            *view,
            torch.tensor([0, view[0].shape[1]]),
            torch.tensor([0, view[4].shape[1]]),
            0.25,
        )
        torch.testing.assert_close(out[b].float(), ref_out[0].float(), atol=tol, rtol=tol)
        torch.testing.assert_close(masses[b][0], ref8.sum(0), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(masses[b][1], reff.sum(0), atol=1e-6, rtol=1e-5)
        total = masses[b][0].sum() + masses[b][1].sum()
        torch.testing.assert_close(total, torch.tensor(float(groups * hkv)))  # each query's mass sums to 1


def test_workspace_is_reused_across_calls():
    gen = torch.Generator().manual_seed(0)
    views = [_storage(2, 0, 8, 16, torch.float32, gen) for _ in range(4)]
    q = torch.randn(4, 6, 16, generator=gen)
    padded_decode_attention(q, views, 0.25)
    buffer = workspace().k.data_ptr()
    padded_decode_attention(q[:3], views[:3], 0.25)  # smaller batch: same buffer
    assert workspace().k.data_ptr() == buffer


def test_fold_attention_equals_after_attention_bit_for_bit():
    from confkv.attention import enable
    from confkv.batched import fold_attention
    from confkv.cache import ConfKVCache
    from confkv.decode import prefill
    from tests.helpers import tiny_llama

    model = tiny_llama(layers=2, seed=1)
    enable(model)
    policies = ["confkv:n_high=24,n_low=12,p=4,s=2,int8=1,w=8", "h2o:n=20", "full", "confkv:decay=0.5"]
    pairs = []
    for i, policy in enumerate(policies):
        caches = [ConfKVCache.for_model(model, policy) for _ in range(2)]
        for cache in caches:
            prefill(model, cache, torch.arange(1, 30 + i)[None], chunk_size=8)
        pairs.append((caches[0].seqs[0], caches[1].seqs[0]))
    gen = torch.Generator().manual_seed(0)
    masses = []
    for seq, _ in pairs:
        store = seq.stores[1]
        masses.append((torch.rand(store.q.n, generator=gen), torch.rand(store.fp.n, generator=gen)))
    for (seq, _), (m8, mf) in zip(pairs, masses, strict=True):
        seq.after_attention(1, m8, mf)
    fold_attention([other for _, other in pairs], 1, masses)
    for seq, other in pairs:
        for name in ("ema", "cum", "pos"):
            assert torch.equal(seq.stores[1].meta(name), other.stores[1].meta(name)), name
        assert seq.nbytes() == other.nbytes()


def test_mixed_decode_batch_equals_each_alone_and_the_reference():
    """A CPU decode batch mixing FP-only sequences of attention-free policies (plain SDPA over
    the storage views) with ranked / INT8 ones (the padded call): every row equals that sequence
    attended alone, and the SDPA rows equal the reference kernel."""
    from confkv.attention import _attend_decode_batch, _attend_one
    from confkv.memory import KVGeometry
    from confkv.policies import parse_policy
    from confkv.sequence import SequenceCache

    gen = torch.Generator().manual_seed(3)
    geo = KVGeometry(n_layers=1, n_kv_heads=2, head_dim=16, dtype_bytes=4)
    specs = ["full", "confkv:n_high=40,n_low=32,p=4,s=2,int8=1,w=8", "window:n=24", "full"]

    def build():
        seqs = [SequenceCache(parse_policy(s), geo, torch.float32, "cpu") for s in specs]
        for i, seq in enumerate(seqs):
            for _ in range(10 + 7 * i):
                seq.before_append(0, 1)
                k, v = torch.randn(2, 1, 16, generator=gen), torch.randn(2, 1, 16, generator=gen)
                seq.append(0, k, v)
        return seqs

    state = gen.get_state()
    batch = build()
    gen.set_state(state)
    alone = build()
    q = torch.randn(len(specs), 6, 1, 16, generator=gen)
    out = _attend_decode_batch(batch, 0, q, 0.25)
    for b, seq in enumerate(alone):
        assert torch.equal(out[b], _attend_one(seq, 0, q[b], 0.25)), specs[b]
        # the padded call sums masses in another order than the reference: equal up to rounding
        torch.testing.assert_close(batch[b].stores[0].meta("ema"), seq.stores[0].meta("ema"))
    for b in (0, 2, 3):  # the SDPA rows against the reference kernel
        kf, vf = batch[b].stores[0].fp.view("k"), batch[b].stores[0].fp.view("v")
        empty8 = torch.zeros(2, 0, 16, dtype=torch.int8), torch.zeros(2, 0, dtype=torch.float16)
        ref, _, _ = reference.decode_attention_ref(
            q[b, :, 0][None], empty8[0], empty8[1], empty8[0], empty8[1], kf, vf,
            torch.tensor([0, 0]), torch.tensor([0, kf.shape[1]]), 0.25,
        )  # fmt: skip
        torch.testing.assert_close(out[b, :, 0], ref[0], atol=1e-5, rtol=1e-5)
