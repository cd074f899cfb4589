"""Triton recall-tier ops: page summaries, Quest page scores, page gather and scatter.

Same signatures, layouts and return types as ``recall_reference`` (its docstring gives the cold
layout). Pool tensors (k8, v8, ks, vs, valid) are used in place through their strides, never
copied: they may be views of a much bigger cold pool, and ``scatter_pages`` must write into them.

- ``summarize_pages``, grid (P, Hkv): bit-exact with the reference. Keys are int8 x f16 products,
  exact in f32; every division is correctly rounded (``div_rn``, not Triton's approximate ``/``)
  and the f16 scale is moved one ulp up through its bits when rounding to f16 lowered it.
- ``page_scores``, one program per ``_BLOCK_P`` pages, looping over KV heads and their G*M query
  rows: the INT8 bounds are dotted as exact small integers and the page scale is applied to the
  column afterwards, so no bound is dequantized in memory.
- ``gather_pages``, grid (R, Hkv): the output size needs one host sync anyway (the reference's
  ``nonzero`` does too), so each page's first output row is a host cumsum of valid counts; the
  rank inside the page is a cumsum over its valid row in the kernel.
- ``scatter_pages``, grid (blocks of tokens, Hkv): writes straight into the pool.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_QMAX = 127.0
_MIN_SCALE = 1e-6
_BLOCK_P = 16  # pages per page_scores program (tl.dot needs >= 16)
_BLOCK_N = 16  # tokens per scatter program


# fmt: off
@triton.jit
def _summarize_pages_kernel(
    k8_ptr, ks_ptr, valid_ptr, lo8_ptr, hi8_ptr, sscale_ptr,
    s_kp, s_kh, s_kt, s_sp, s_sh, s_vp, n_heads, page_size, head_dim,
    QMAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    page, head = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)  # int64: big pools
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    valid = tl.load(valid_ptr + page * s_vp + offs_s, mask=offs_s < page_size, other=0) != 0
    mask = valid[:, None] & d_mask[None, :]
    k = tl.load(k8_ptr + page * s_kp + head * s_kh + offs_s[:, None] * s_kt + offs_d[None, :],
                mask=mask, other=0)
    ks = tl.load(ks_ptr + page * s_sp + head * s_sh + offs_s, mask=valid, other=0.0)
    keys = k.to(tl.float32) * ks.to(tl.float32)[:, None]
    # Empty pages and padded dims get 0, which leaves amax unchanged for the others.
    keep = d_mask & (tl.max(valid.to(tl.int32), axis=0) > 0)
    lo = tl.where(keep, tl.min(tl.where(mask, keys, float("inf")), axis=0), 0.0)
    hi = tl.where(keep, tl.max(tl.where(mask, keys, float("-inf")), axis=0), 0.0)
    amax = tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), axis=0)
    scale = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32)), MIN_SCALE)
    s16 = scale.to(tl.float16)
    up = (s16.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)  # scale > 0: bits + 1 = next up
    s16 = tl.where(s16.to(tl.float32) < scale, up, s16)
    s = tl.broadcast_to(s16.to(tl.float32), lo.shape)
    # The rounded quotient can land on the far side of an integer: step once more outward.
    lo_q = tl.floor(tl.math.div_rn(lo, s))
    lo_q = tl.where(lo_q * s > lo, lo_q - 1.0, lo_q)
    hi_q = tl.ceil(tl.math.div_rn(hi, s))
    hi_q = tl.where(hi_q * s < hi, hi_q + 1.0, hi_q)
    row = page * n_heads + head
    tl.store(lo8_ptr + row * head_dim + offs_d, tl.clamp(lo_q, -128.0, 127.0).to(tl.int8), mask=d_mask)
    tl.store(hi8_ptr + row * head_dim + offs_d, tl.clamp(hi_q, -128.0, 127.0).to(tl.int8), mask=d_mask)
    tl.store(sscale_ptr + row, s16)


@triton.jit
def _page_scores_kernel(
    q_ptr, lo8_ptr, hi8_ptr, sscale_ptr, lse_ptr, out_ptr,
    s_qh, s_qm, n_pages, n_kv_heads, n_queries, head_dim, scaling,
    GROUPS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_p = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    p_mask = offs_p < n_pages
    pd_mask = p_mask[:, None] & (offs_d[None, :] < head_dim)
    n_rows = GROUPS * n_queries  # rows of KV head g: query heads g*G .. g*G+G-1, all M queries each
    best = tl.full((BLOCK_P,), float("-inf"), tl.float32)
    for g in range(n_kv_heads):
        bounds = (offs_p[:, None] * n_kv_heads + g) * head_dim + offs_d[None, :]
        hi = tl.load(hi8_ptr + bounds, mask=pd_mask, other=0)
        lo = tl.load(lo8_ptr + bounds, mask=pd_mask, other=0)
        col_scale = tl.load(sscale_ptr + offs_p * n_kv_heads + g, mask=p_mask, other=0.0).to(tl.float32)
        for r0 in range(0, n_rows, BLOCK_R):
            rows = r0 + offs_r
            r_mask = rows < n_rows
            head = g * GROUPS + rows // n_queries
            query = rows % n_queries
            q = tl.load(q_ptr + head[:, None] * s_qh + query[:, None] * s_qm + offs_d[None, :],
                        mask=r_mask[:, None] & (offs_d[None, :] < head_dim), other=0.0)
            q_pos = tl.where(q > 0, q, tl.zeros_like(q))
            ub = tl.dot(q_pos, tl.trans(hi.to(q.dtype)), input_precision=DOT_PRECISION)
            ub += tl.dot(q - q_pos, tl.trans(lo.to(q.dtype)), input_precision=DOT_PRECISION)
            lse = tl.load(lse_ptr + head * n_queries + query, mask=r_mask, other=0.0)
            rel = ub * (col_scale * scaling)[None, :] - lse[:, None]
            best = tl.maximum(best, tl.max(tl.where(r_mask[:, None], rel, float("-inf")), axis=0))
    tl.store(out_ptr + offs_p, best, mask=p_mask)


@triton.jit
def _gather_pages_kernel(
    k8_ptr, v8_ptr, ks_ptr, vs_ptr, valid_ptr, slots_ptr, starts_ptr,
    ok8_ptr, ov8_ptr, oks_ptr, ovs_ptr, flat_ptr,
    s_kp, s_kh, s_kt, s_sp, s_sh, s_vp, n_out, page_size, head_dim,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    sel, head = tl.program_id(0), tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + sel).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    valid = tl.load(valid_ptr + slot * s_vp + offs_s, mask=offs_s < page_size, other=0).to(tl.int32)
    keep = valid != 0
    dest = tl.load(starts_ptr + sel) + tl.cumsum(valid, axis=0) - 1  # offset order inside the page
    mask = keep[:, None] & (offs_d[None, :] < head_dim)
    src = slot * s_kp + head * s_kh + offs_s[:, None] * s_kt + offs_d[None, :]
    dst = (head * n_out + dest)[:, None] * head_dim + offs_d[None, :]
    tl.store(ok8_ptr + dst, tl.load(k8_ptr + src, mask=mask), mask=mask)
    tl.store(ov8_ptr + dst, tl.load(v8_ptr + src, mask=mask), mask=mask)
    src_s = slot * s_sp + head * s_sh + offs_s
    tl.store(oks_ptr + head * n_out + dest, tl.load(ks_ptr + src_s, mask=keep), mask=keep)
    tl.store(ovs_ptr + head * n_out + dest, tl.load(vs_ptr + src_s, mask=keep), mask=keep)
    if head == 0:
        tl.store(flat_ptr + dest, slot * page_size + offs_s, mask=keep)


@triton.jit
def _scatter_pages_kernel(
    k8_ptr, v8_ptr, ks_ptr, vs_ptr, valid_ptr, slot_ptr, offset_ptr, tk8_ptr, tv8_ptr, tks_ptr, tvs_ptr,
    s_kp, s_kh, s_kt, s_sp, s_sh, s_vp, n_tokens, head_dim,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    head = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    n_mask = offs_n < n_tokens
    slot = tl.load(slot_ptr + offs_n, mask=n_mask, other=0).to(tl.int64)
    offset = tl.load(offset_ptr + offs_n, mask=n_mask, other=0).to(tl.int64)
    mask = n_mask[:, None] & (offs_d[None, :] < head_dim)
    src = (head * n_tokens + offs_n)[:, None] * head_dim + offs_d[None, :]
    dst = slot[:, None] * s_kp + head * s_kh + offset[:, None] * s_kt + offs_d[None, :]
    tl.store(k8_ptr + dst, tl.load(tk8_ptr + src, mask=mask), mask=mask)
    tl.store(v8_ptr + dst, tl.load(tv8_ptr + src, mask=mask), mask=mask)
    dst_s = slot * s_sp + head * s_sh + offset
    tl.store(ks_ptr + dst_s, tl.load(tks_ptr + head * n_tokens + offs_n, mask=n_mask), mask=n_mask)
    tl.store(vs_ptr + dst_s, tl.load(tvs_ptr + head * n_tokens + offs_n, mask=n_mask), mask=n_mask)
    if head == 0:
        tl.store(valid_ptr + slot * s_vp + offset, tl.full((BLOCK_N,), 1, tl.uint8), mask=n_mask)
# fmt: on


def _pool_strides(k8, v8, ks, vs, valid) -> tuple[int, ...]:
    """(k8 page, head, token; scale page, head; valid page) strides, shared by K and V."""
    if k8.stride() != v8.stride() or ks.stride() != vs.stride():
        raise ValueError("k8/v8 and ks/vs must share a layout")
    if k8.stride(-1) != 1 or ks.stride(-1) != 1 or valid.stride(-1) != 1:
        raise ValueError("cold pool tensors must be unit-stride in their last dim")
    return (*k8.stride()[:3], *ks.stride()[:2], valid.stride(0))


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def summarize_pages(
    k8: torch.Tensor, ks: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k8 (P, Hkv, S, D) int8, ks (P, Hkv, S) f16, valid (P, S) -> lo8, hi8 (P, Hkv, D) int8,
    sscale (P, Hkv) f16; same contract as ``recall_reference.summarize_pages_ref``."""
    pages, kv_heads, page_size, head_dim = k8.shape
    lo8 = torch.empty((pages, kv_heads, head_dim), dtype=torch.int8, device=k8.device)
    hi8 = torch.empty_like(lo8)
    sscale = torch.empty((pages, kv_heads), dtype=torch.float16, device=k8.device)
    if lo8.numel() == 0:
        return lo8, hi8, sscale
    _summarize_pages_kernel[(pages, kv_heads)](
        k8, ks, valid.view(torch.uint8), lo8, hi8, sscale,
        *_pool_strides(k8, k8, ks, ks, valid), kv_heads, page_size, head_dim,
        QMAX=_QMAX, MIN_SCALE=_MIN_SCALE, BLOCK_S=triton.next_power_of_2(page_size),
        BLOCK_D=_block_d(head_dim),
    )  # fmt: skip
    return lo8, hi8, sscale


def page_scores(q, lo8, hi8, sscale, lse, scaling: float) -> torch.Tensor:
    """q (Hq, M, D); lo8/hi8 (P, Hkv, D) int8, sscale (P, Hkv) f16; lse (Hq, M) -> (P,) float32:
    max over heads and queries of scaling * Quest bound - lse (``recall_reference.page_scores_ref``)."""
    q_heads, n_queries, head_dim = q.shape
    pages, kv_heads, _ = lo8.shape
    out = torch.empty(pages, dtype=torch.float32, device=q.device)
    if pages == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    groups = q_heads // kv_heads
    block_r = min(64, max(16, triton.next_power_of_2(groups * n_queries)))
    _page_scores_kernel[(triton.cdiv(pages, _BLOCK_P),)](
        q, lo8.contiguous(), hi8.contiguous(), sscale.contiguous(), lse.float().contiguous(), out,
        q.stride(0), q.stride(1), pages, kv_heads, n_queries, head_dim, float(scaling),
        GROUPS=groups, BLOCK_P=_BLOCK_P, BLOCK_R=block_r, BLOCK_D=_block_d(head_dim),
        # fp32 queries get fp32 products: TF32's ~1e-3 error could push the bound below the truth.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out


def gather_pages(k8, v8, ks, vs, valid, slots):
    """Valid tokens of pages ``slots`` (R,) -> k8, v8 (Hkv, n, D), ks, vs (Hkv, n), flat (n,) int64,
    page-major in ``slots`` order, offsets ascending (``recall_reference.gather_pages_ref``)."""
    _, kv_heads, page_size, head_dim = k8.shape
    counts = valid.index_select(0, slots).sum(1)
    ends = counts.cumsum(0)
    n_out = int(ends[-1]) if slots.numel() else 0
    ok8 = torch.empty((kv_heads, n_out, head_dim), dtype=k8.dtype, device=k8.device)
    ov8 = torch.empty_like(ok8)
    oks = torch.empty((kv_heads, n_out), dtype=ks.dtype, device=k8.device)
    ovs = torch.empty_like(oks)
    flat = torch.empty(n_out, dtype=torch.int64, device=k8.device)
    if n_out == 0 or kv_heads == 0:
        return ok8, ov8, oks, ovs, flat
    _gather_pages_kernel[(slots.numel(), kv_heads)](
        k8, v8, ks, vs, valid.view(torch.uint8), slots, ends - counts, ok8, ov8, oks, ovs, flat,
        *_pool_strides(k8, v8, ks, vs, valid), n_out, page_size, head_dim,
        BLOCK_S=triton.next_power_of_2(page_size), BLOCK_D=_block_d(head_dim),
    )  # fmt: skip
    return ok8, ov8, oks, ovs, flat


def scatter_pages(k8, v8, ks, vs, valid, slot, offset, tk8, tv8, tks, tvs) -> None:
    """In place: tokens tk8/tv8 (Hkv, n, D), tks/tvs (Hkv, n) go to pages ``slot`` (n,) at ``offset``
    (n,), which become valid (``recall_reference.scatter_pages_ref``)."""
    kv_heads, n_tokens, head_dim = tk8.shape
    if n_tokens == 0 or kv_heads == 0:
        return
    strides = _pool_strides(k8, v8, ks, vs, valid)
    _scatter_pages_kernel[(triton.cdiv(n_tokens, _BLOCK_N), kv_heads)](
        k8, v8, ks, vs, valid.view(torch.uint8), slot.contiguous(), offset.contiguous(),
        tk8.contiguous(), tv8.contiguous(), tks.contiguous(), tvs.contiguous(),
        *strides, n_tokens, head_dim, BLOCK_N=_BLOCK_N, BLOCK_D=_block_d(head_dim),
    )  # fmt: skip
