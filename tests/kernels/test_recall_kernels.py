"""Recall-tier Triton ops vs ``recall_reference`` (CUDA when present, else TRITON_INTERPRET=1 on the CPU).

Cold pages hold random INT8 payloads with per-token f16 scales spanning several decades; every case
has an empty page, a full page and a page whose only token sits at the last offset.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    # Must precede the first import of triton.language (the repo-root conftest.py does it for a suite run).
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

import confkv_kernels  # noqa: E402
from confkv_kernels import Backend, triton_ops  # noqa: E402
from confkv_kernels import recall_reference as ref  # noqa: E402
from confkv_kernels.reference import quantize_int8_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGES = 8
SCORED_PAGES = 20  # > one 16-page block of page_scores
# bf16 tl.dot is wrong in the interpreter: bf16 queries are checked on CUDA only.
Q_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
SCORE_TOL = {torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-4}

dims = pytest.mark.parametrize("dim", [64, 128])
kv_heads_ = pytest.mark.parametrize("kv_heads", [1, 3])
page_sizes = pytest.mark.parametrize("page_size", [16, 32])


def _cold_pool(pages, kv_heads, page_size, dim, seed=0):
    """k8, v8 (P, Hkv, S, D) int8, ks, vs (P, Hkv, S) f16, valid (P, S) bool on DEVICE."""
    gen = torch.Generator().manual_seed(seed)

    def payload():
        magnitude = 10 ** (5 * torch.rand(pages * kv_heads, 1, 1, generator=gen) - 3)  # 1e-3 .. 1e2
        x = magnitude * torch.randn(pages * kv_heads, page_size, dim, generator=gen)
        x8, scale = quantize_int8_ref(x)
        return x8.view(pages, kv_heads, page_size, dim).to(DEVICE), scale.view(pages, kv_heads, -1).to(DEVICE)

    k8, ks = payload()
    v8, vs = payload()
    valid = torch.rand(pages, page_size, generator=gen) < 0.4
    valid[0] = False
    valid[1] = True
    valid[2] = False
    valid[2, -1] = True
    return k8, v8, ks, vs, valid.to(DEVICE)


def _tokens(kv_heads, n, dim, seed):
    """Hot-layout tokens: tk8, tv8 (Hkv, n, D) int8, tks, tvs (Hkv, n) f16."""
    gen = torch.Generator().manual_seed(seed)
    k8, ks = quantize_int8_ref(torch.randn(kv_heads, n, dim, generator=gen))
    v8, vs = quantize_int8_ref(torch.randn(kv_heads, n, dim, generator=gen))
    return [t.to(DEVICE) for t in (k8, v8, ks, vs)]


def _assert_bounds_hold(k8, ks, valid, lo8, hi8, sscale):
    keys = k8.float() * ks.float().unsqueeze(-1)  # (P, Hkv, S, D), exact
    s = sscale.float()[:, :, None, None]
    m = valid[:, None, :, None].expand_as(keys)
    assert bool(((lo8.float().unsqueeze(2) * s <= keys) | ~m).all())
    assert bool(((keys <= hi8.float().unsqueeze(2) * s) | ~m).all())


def _assert_equal(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w)


@page_sizes
@kv_heads_
@dims
def test_summarize_matches_reference(dim, kv_heads, page_size):
    k8, _, ks, _, valid = _cold_pool(PAGES, kv_heads, page_size, dim)
    got = triton_ops.summarize_pages(k8, ks, valid)
    _assert_equal(got, ref.summarize_pages_ref(k8, ks, valid))
    _assert_bounds_hold(k8, ks, valid, *got)
    assert not got[0][0].any() and not got[1][0].any()  # the empty page


@pytest.mark.parametrize("dtype", Q_DTYPES, ids=str)
@page_sizes
@pytest.mark.parametrize("groups", [1, 3])
@kv_heads_
@dims
def test_page_scores_matches_reference(dim, kv_heads, groups, page_size, dtype):
    k8, _, ks, _, valid = _cold_pool(SCORED_PAGES, kv_heads, page_size, dim, seed=1)
    summary = ref.summarize_pages_ref(k8, ks, valid)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(kv_heads * groups, 5, dim, generator=gen).to(DEVICE, dtype)
    lse = (10 * torch.randn(kv_heads * groups, 5, generator=gen)).to(DEVICE)
    got = triton_ops.page_scores(q, *summary, lse, dim**-0.5)
    want = ref.page_scores_ref(q, *summary, lse, dim**-0.5)
    assert got.dtype == torch.float32 and got.shape == (SCORED_PAGES,)
    torch.testing.assert_close(got, want, atol=SCORE_TOL[dtype], rtol=SCORE_TOL[dtype])


def test_page_scores_many_queries_and_strided_q():
    # 3 groups x 30 queries = 90 rows: more than one 64-row block per KV head; q a transposed view.
    k8, _, ks, _, valid = _cold_pool(SCORED_PAGES, 2, 16, 64, seed=3)
    summary = ref.summarize_pages_ref(k8, ks, valid)
    q = torch.randn(30, 6, 64, device=DEVICE).transpose(0, 1)
    lse = torch.randn(6, 30, device=DEVICE)
    want = ref.page_scores_ref(q, *summary, lse, 0.125)
    torch.testing.assert_close(triton_ops.page_scores(q, *summary, lse, 0.125), want, atol=1e-5, rtol=1e-5)


@page_sizes
@kv_heads_
@dims
def test_gather_matches_reference(dim, kv_heads, page_size):
    pool = _cold_pool(PAGES, kv_heads, page_size, dim, seed=4)
    slots = torch.tensor([6, 0, 1, 2, 7, 3, 1], device=DEVICE)  # unsorted, a repeat; empty, full, last-offset
    _assert_equal(triton_ops.gather_pages(*pool, slots), ref.gather_pages_ref(*pool, slots))


@page_sizes
@kv_heads_
@dims
def test_scatter_matches_reference(dim, kv_heads, page_size):
    pool = _cold_pool(PAGES, kv_heads, page_size, dim, seed=5)
    n = 37  # > two 16-token blocks; lands on valid (overwritten) and free offsets alike
    flat = torch.randperm(PAGES * page_size, generator=torch.Generator().manual_seed(6))[:n].to(DEVICE)
    tokens = _tokens(kv_heads, n, dim, seed=7)
    want = [t.clone() for t in pool]
    ref.scatter_pages_ref(*want, flat // page_size, flat % page_size, *tokens)
    got = [t.clone() for t in pool]
    assert triton_ops.scatter_pages(*got, flat // page_size, flat % page_size, *tokens) is None
    _assert_equal(got, want)


def test_recall_round_trip():
    # Evict tokens at scattered positions into an empty pool, recall every page: same tokens, same order.
    kv_heads, page_size, dim, pages = 2, 16, 64, 6
    positions = torch.randperm(pages * page_size, generator=torch.Generator().manual_seed(8))[:40]
    positions = positions.sort().values.to(DEVICE)
    tokens = _tokens(kv_heads, 40, dim, seed=9)
    pool = [torch.zeros_like(t) for t in _cold_pool(pages, kv_heads, page_size, dim)]
    triton_ops.scatter_pages(*pool, positions // page_size, positions % page_size, *tokens)
    *recalled, flat = triton_ops.gather_pages(*pool, torch.arange(pages, device=DEVICE))
    assert torch.equal(flat, positions)
    _assert_equal(recalled, tokens)


def _pool_view(t):
    """The same values inside a buffer with 3 spare slots per page: strided, non-contiguous pages."""
    axis = 2 if t.dim() == 4 else t.dim() - 1  # the token axis
    shape = list(t.shape)
    shape[axis] += 3
    view = torch.zeros(shape, dtype=t.dtype, device=t.device).narrow(axis, 0, t.shape[axis])
    return view.copy_(t)


def test_pool_views_are_used_in_place():
    pool = _cold_pool(PAGES, 2, 16, 64, seed=10)
    views = [_pool_view(t) for t in pool]
    assert not any(v.is_contiguous() for v in views)
    slots = torch.tensor([5, 1, 0, 2], device=DEVICE)
    _assert_equal(triton_ops.gather_pages(*views, slots), ref.gather_pages_ref(*pool, slots))
    _assert_equal(
        triton_ops.summarize_pages(views[0], views[2], views[4]), ref.summarize_pages_ref(*pool[::2])
    )
    flat = torch.tensor([0, 17, 40, 41, 120], device=DEVICE)
    tokens = _tokens(2, 5, 64, seed=11)
    want = [t.clone() for t in pool]
    ref.scatter_pages_ref(*want, flat // 16, flat % 16, *tokens)
    triton_ops.scatter_pages(*views, flat // 16, flat % 16, *tokens)
    _assert_equal([v.contiguous() for v in views], want)


def test_empty_inputs():
    k8, v8, ks, vs, valid = _cold_pool(4, 2, 16, 64)
    lo8, hi8, sscale = triton_ops.summarize_pages(k8[:0], ks[:0], valid[:0])
    assert lo8.shape == hi8.shape == (0, 2, 64) and sscale.shape == (0, 2)
    q, lse = torch.randn(2, 3, 64, device=DEVICE), torch.zeros(2, 3, device=DEVICE)
    assert triton_ops.page_scores(q, lo8, hi8, sscale, lse, 1.0).shape == (0,)
    for slots in ([], [0, 0]):  # nothing selected; only the empty page selected
        slots = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
        pool = (k8, v8, ks, vs, valid)
        _assert_equal(triton_ops.gather_pages(*pool, slots), ref.gather_pages_ref(*pool, slots))
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    before = valid.clone()
    no_tokens = (k8[0, :, :0], v8[0, :, :0], ks[0, :, :0], vs[0, :, :0])
    triton_ops.scatter_pages(k8, v8, ks, vs, valid, none, none, *no_tokens)
    assert torch.equal(valid, before)


def test_through_dispatch():
    pool = _cold_pool(8, 2, 16, 64, seed=12)
    slots = torch.tensor([3, 1], device=DEVICE)
    got = confkv_kernels.gather_pages(*pool, slots, backend=Backend.TRITON)
    _assert_equal(got, ref.gather_pages_ref(*pool, slots))
    got = confkv_kernels.summarize_pages(pool[0], pool[2], pool[4], backend=Backend.TRITON)
    _assert_equal(got, ref.summarize_pages_ref(pool[0], pool[2], pool[4]))


# --- the page score is an upper bound of the true max q.k over the page's valid keys ---------------


@st.composite
def _bound_cases(draw):
    pages, kv_heads = draw(st.integers(1, 4)), draw(st.sampled_from([1, 2]))
    groups, queries, page_size, dim = draw(st.sampled_from([1, 3])), draw(st.integers(1, 3)), 16, 16
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    log_scale = draw(st.floats(-7.0, 3.0))  # key scales from f16 subnormals to 1e3
    k8 = torch.randint(-128, 128, (pages, kv_heads, page_size, dim), generator=gen, dtype=torch.int8)
    if draw(st.booleans()):  # every key on one f16 grid: the bound can be tight, no slack from rounding
        ks = torch.full((pages, kv_heads, page_size), 10**log_scale)
    else:
        ks = 10 ** (log_scale + torch.randn(pages, kv_heads, page_size, generator=gen))
    ks = ks.clamp(max=6e4).half()
    valid = torch.rand(pages, page_size, generator=gen) < draw(st.sampled_from([0.0, 0.05, 0.5, 1.0]))
    q = torch.randn(kv_heads * groups, queries, dim, generator=gen) * 10 ** draw(st.floats(-2.0, 2.0))
    return q.to(DEVICE), k8.to(DEVICE), ks.to(DEVICE), valid.to(DEVICE)


@pytest.mark.parametrize(
    ("summarize", "scores", "examples"),
    [
        (ref.summarize_pages_ref, ref.page_scores_ref, 60),
        (triton_ops.summarize_pages, triton_ops.page_scores, 25),
    ],
    ids=["reference", "triton"],
)
def test_page_score_bounds_true_max(summarize, scores, examples):
    @settings(max_examples=examples, deadline=None, database=None)
    @given(case=_bound_cases())
    def check(case):
        q, k8, ks, valid = case
        summary = summarize(k8, ks, valid)
        _assert_bounds_hold(k8, ks, valid, *summary)
        kv_heads = k8.shape[1]
        got = scores(q, *summary, torch.zeros(q.shape[:2], device=DEVICE), 1.0)
        keys = k8.double() * ks.double().unsqueeze(-1)  # (P, Hkv, S, D)
        qg = q.double().reshape(kv_heads, -1, q.shape[-1])  # (Hkv, G*M, D)
        dots = torch.einsum("grd,pgsd->pgrs", qg, keys)
        # float dot products are only as exact as the size of their terms: 1e-4 of sum |q_d k_d|
        mag = torch.einsum("grd,pgsd->pgrs", qg.abs(), keys.abs())
        m = valid[:, None, None, :].expand_as(dots)
        true_max = dots.masked_fill(~m, float("-inf")).flatten(1).amax(1)
        slack = 1e-4 * mag.masked_fill(~m, 0.0).flatten(1).amax(1)
        assert bool((got.double() >= true_max - slack).all()), (got, true_max)

    check()
