"""Mixed INT8/FP storage: quantization error, compaction, exact byte accounting."""

from __future__ import annotations

import torch
from confkv_kernels.reference import decode_attention_ref, dequantize_int8_ref, quantize_int8_ref

from confkv.storage import LayerStore


def test_int8_round_trip_error_is_at_most_half_a_step():
    x = torch.randn(3, 50, 64) * torch.logspace(-2, 1, 50).view(1, 50, 1)
    x8, scale = quantize_int8_ref(x)
    assert x8.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == (3, 50)
    err = (dequantize_int8_ref(x8, scale, torch.float32) - x).abs()
    bound = scale.float().unsqueeze(-1) * 0.5 + 1e-7
    assert (err <= bound).all()
    rel = err.amax(-1) / x.abs().amax(-1)
    assert rel.max() < 1 / 127 + 1e-3


def test_attention_over_int8_is_close_to_fp_attention():
    g = torch.Generator().manual_seed(0)
    hkv, groups, n, d = 2, 3, 200, 64
    q = torch.randn(1, hkv * groups, d, generator=g)
    k, v = torch.randn(hkv, n, d, generator=g), torch.randn(hkv, n, d, generator=g)
    empty8, empty_s = torch.zeros(hkv, 0, d, dtype=torch.int8), torch.zeros(hkv, 0, dtype=torch.float16)
    full_off = torch.tensor([0, n], dtype=torch.int32)
    zero_off = torch.tensor([0, 0], dtype=torch.int32)
    ref, _, ref_mass = decode_attention_ref(
        q, empty8, empty_s, empty8, empty_s, k, v, zero_off, full_off, 0.125
    )
    w = 32  # the newest 32 tokens stay FP, the rest INT8
    k8, ks = quantize_int8_ref(k[:, : n - w])
    v8, vs = quantize_int8_ref(v[:, : n - w])
    out, m8, mf = decode_attention_ref(
        q,
        k8,
        ks,
        v8,
        vs,
        k[:, n - w :],
        v[:, n - w :],
        torch.tensor([0, n - w], dtype=torch.int32),
        torch.tensor([0, w], dtype=torch.int32),
        0.125,
    )
    assert (out - ref).abs().max() < 2e-2
    assert (torch.cat([m8, mf], 1) - ref_mass).abs().max() < 2e-2
    assert torch.allclose(torch.cat([m8, mf], 1).sum(1), torch.full((hkv,), float(groups)), atol=1e-4)


def _stored_nbytes(store: LayerStore) -> int:
    return sum(t.nbytes for t in store.kv_views())


def test_store_demotes_old_tokens_compacts_and_counts_bytes_exactly():
    store = LayerStore(2, 8, torch.float32, "cpu", int8=True, window=4)
    g = torch.Generator().manual_seed(0)
    for step in range(30):
        store.demote_old(1)
        store.append(torch.randn(2, 1, 8, generator=g), torch.randn(2, 1, 8, generator=g))
        assert store.fp.n <= 4
        assert (store.fp.view("pos") >= store.next_pos - 4).all()
        if len(store) > 10:
            mask = torch.ones(len(store), dtype=torch.bool)
            mask[step % len(store)] = False
            store.keep(mask)
        assert store.nbytes() == _stored_nbytes(store) == store.nbytes_fast()
        positions = store.meta("pos")
        assert positions.unique().numel() == positions.numel() == len(store)
    assert store.q.n > 0 and store.nbytes() == store.fp.n * 2 * 2 * 8 * 4 + store.q.n * 2 * 2 * (8 + 2)


def test_demotion_ahead_runs_every_few_steps_and_never_widens_the_window():
    """With ``ahead`` (the policy's slack) demotion moves a batch of the oldest FP tokens about
    every ``ahead`` steps; the FP window never holds more than ``window`` tokens, every token
    older than the window is INT8, and the INT8 tokens equal what per-step demotion stores."""
    g = torch.Generator().manual_seed(1)
    chunks = [(torch.randn(2, 1, 8, generator=g), torch.randn(2, 1, 8, generator=g)) for _ in range(60)]
    stores = {ahead: LayerStore(2, 8, torch.float32, "cpu", int8=True, window=8) for ahead in (0, 6)}
    moves = {ahead: 0 for ahead in stores}
    for k, v in chunks:
        for ahead, store in stores.items():
            before = store.q.n
            store.demote_old(1, ahead)
            moves[ahead] += store.q.n != before
            store.append(k, v)
            assert store.fp.n <= 8
            assert (store.fp.view("pos") >= store.next_pos - 8).all()
            assert store.nbytes() == store.nbytes_fast()
    assert moves[6] <= moves[0] // 5 and moves[0] >= 50
    per_step, batched = stores[0], stores[6]
    for name in ("k", "ks", "v", "vs"):  # an INT8 token is the same bytes whenever it was demoted
        order_a, order_b = per_step.q.view("pos").argsort(), batched.q.view("pos").argsort()
        a, b = per_step.q.view(name).index_select(1, order_a), batched.q.view(name).index_select(1, order_b)
        assert torch.equal(a[:, : b.shape[1]], b[:, : a.shape[1]])


def test_keep_preserves_the_kept_tokens_values():
    store = LayerStore(1, 4, torch.float32, "cpu", int8=False, window=1 << 30)
    keys = torch.arange(40, dtype=torch.float32).view(1, 10, 4)
    store.append(keys, keys.clone())
    mask = torch.tensor([True, False, True, False, False, True, True, False, True, True])
    store.keep(mask)
    kept = dict(zip(store.meta("pos").tolist(), store.fp.view("k")[0].tolist(), strict=True))
    assert sorted(kept) == [0, 2, 5, 6, 8, 9]
    for pos, row in kept.items():
        assert row == keys[0, pos].tolist()


def test_an_appended_token_starts_with_zero_statistics_after_evictions():
    """Appends do not write the EMA, cumulative attention or pin: ``keep`` zeroes the slots it
    frees, so a token appended into a slot an evicted token held starts from zero."""
    store = LayerStore(1, 4, torch.float32, "cpu", int8=False, window=1 << 30)
    store.append(torch.randn(1, 8, 4), torch.randn(1, 8, 4))
    store.add_attention(torch.zeros(0), torch.rand(8) + 0.5, decay=0.5)
    store.fp.view("pin").fill_(99)
    store.keep(torch.tensor([False, True, False, True, True, False, True, True]))
    for _ in range(5):  # decode appends reuse the freed slots one by one
        store.append(torch.randn(1, 1, 4), torch.randn(1, 1, 4))
    fresh = store.fp.view("pos") >= 8
    assert int(fresh.sum()) == 5
    for name in ("ema", "cum", "pin"):
        assert torch.all(store.fp.view(name)[fresh] == 0), name
        assert torch.all(store.fp.view(name)[~fresh] != 0), name


def test_evict_int8_keeps_like_keep_and_returns_the_rest_in_int8():
    """``evict_int8(mask)`` leaves the store exactly as ``keep(mask)`` would (the same tokens with
    the same values and statistics) and returns the others: INT8 slots byte for byte, FP slots
    quantized as ``demote_old`` would; the freed slots' statistics are zero."""
    g = torch.Generator().manual_seed(4)
    stores = [LayerStore(2, 8, torch.float32, "cpu", int8=True, window=6) for _ in range(2)]
    k, v = torch.randn(2, 30, 8, generator=g), torch.randn(2, 30, 8, generator=g)
    mass8, massf = torch.rand(24, generator=g), torch.rand(6, generator=g)
    for store in stores:
        store.append(k, v)
        store.demote_old()  # 24 INT8 + 6 FP
        store.add_attention(mass8, massf, 0.5)
    mask = torch.rand(30, generator=g) > 0.4
    mask[3], mask[27] = False, False  # an INT8 and an FP token leave at least
    a, b = stores
    gone = a.evict_int8(mask)
    b_pos, b_q, b_fp = b.meta("pos"), b.q.n, b.fp.n
    b.keep(mask)
    for part_a, part_b in ((a.q, b.q), (a.fp, b.fp)):
        order_a, order_b = part_a.view("pos").argsort(), part_b.view("pos").argsort()
        for name in part_a.t:
            ax = part_a.axis[name]
            assert torch.equal(
                part_a.view(name).index_select(ax, order_a), part_b.view(name).index_select(ax, order_b)
            )
            if name in ("ema", "cum", "pin"):
                assert torch.all(part_a.t[name][part_a.n :] == 0)
    assert sorted(gone["pos"].tolist()) == sorted(b_pos[~mask].tolist()) and b_q + b_fp == 30
    q_gone = gone["pos"] < 24
    fp_k8, fp_ks = quantize_int8_ref(k[:, gone["pos"][~q_gone]])
    assert torch.equal(gone["k"][:, ~q_gone], fp_k8) and torch.equal(gone["ks"][:, ~q_gone], fp_ks)
    q_k8, _ = quantize_int8_ref(k[:, gone["pos"][q_gone]])
    assert torch.equal(gone["k"][:, q_gone], q_k8)
    assert a.evict_int8(torch.ones(len(a), dtype=torch.bool)) == {}
