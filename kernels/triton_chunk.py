"""Triton chunk (prefill) attention of one sequence over the INT8 tail + FP window, causal by position.

Pass 1 ``_chunk_fwd_kernel``, grid (M / BLOCK_M, Hq): flash attention of BLOCK_M queries of one
head; INT8 blocks first (every INT8 token is older than every query, so no mask), then FP blocks
masked by ``posf <= q_pos`` (slots are unordered, so visibility comes from positions; a block
whose oldest slot is newer than the tile's newest query is skipped). Writes the output and the
per-row log-sum-exp (base 2).

Pass 2 ``_chunk_mass_kernel``, grid (N / BLOCK_N, Hkv): the per-key mass is a column sum of the
normalized probabilities, which are only known once a row's log-sum-exp is final. Storing the
(Hq, M, N) logits would cost far more memory than the keys, so this pass recomputes Q.K^T for
one key block against every query of the group (like the dK pass of a flash backward) and sums
``exp2(logit - lse)`` over queries and heads: no atomics, one plain store per key.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from confkv_kernels.triton_decode import _LOG2E, _dot_precision, _same_rows

_BLOCK_N = 64
_POS_NEVER = tl.constexpr(2**62)  # position of padding slots: newer than any query, so never visible


@triton.jit
def _chunk_segment(
    q,
    q_pos,
    q_newest,
    acc,
    m_i,
    l_i,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    pos_ptr,
    stride_t,
    stride_s,
    n_slots,
    offs_d,
    d_mask,
    qk_scale,
    QUANT: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    for start in range(0, n_slots, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_slots
        if CAUSAL:
            pos = tl.load(pos_ptr + offs_n, mask=n_mask, other=_POS_NEVER)
            visible = pos[None, :] <= q_pos[:, None]
            any_visible = tl.min(pos, axis=0) <= q_newest
        else:
            visible = n_mask[None, :] & (q_pos[:, None] >= 0)
            any_visible = True
        if any_visible:
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + offs_n[:, None] * stride_t + offs_d[None, :], mask=kv_mask, other=0)
            qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)  # (M, N) fp32
            if QUANT:
                qk = qk * tl.load(ks_ptr + offs_n * stride_s, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            qk = tl.where(visible, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(qk - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + offs_n[:, None] * stride_t + offs_d[None, :], mask=kv_mask, other=0)
            if QUANT:
                p = p * tl.load(vs_ptr + offs_n * stride_s, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
            m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _chunk_fwd_kernel(
    q_ptr,
    k8_ptr,
    k8s_ptr,
    v8_ptr,
    v8s_ptr,
    kf_ptr,
    vf_ptr,
    qpos_ptr,
    posf_ptr,
    out_ptr,
    lse_ptr,
    stride_qh,
    stride_qm,
    stride_8h,
    stride_8t,
    stride_sh,
    stride_st,
    stride_fh,
    stride_ft,
    stride_oh,
    stride_om,
    n_queries,
    n8,
    nf,
    qk_scale,
    head_dim,
    GROUPS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile, head = tl.program_id(0), tl.program_id(1)
    kv = (head // GROUPS).to(tl.int64)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < n_queries
    d_mask = offs_d < head_dim
    q = tl.load(
        q_ptr + head * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_pos = tl.load(qpos_ptr + offs_m, mask=m_mask, other=-1)  # padding rows see nothing
    q_newest = tl.max(q_pos, axis=0)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc, m_i, l_i = _chunk_segment(
        q,
        q_pos,
        q_newest,
        acc,
        m_i,
        l_i,
        k8_ptr + kv * stride_8h,
        v8_ptr + kv * stride_8h,
        k8s_ptr + kv * stride_sh,
        v8s_ptr + kv * stride_sh,
        posf_ptr,
        stride_8t,
        stride_st,
        n8,
        offs_d,
        d_mask,
        qk_scale,
        True,
        False,
        BLOCK_N,
        DOT_PRECISION,
    )
    acc, m_i, l_i = _chunk_segment(
        q,
        q_pos,
        q_newest,
        acc,
        m_i,
        l_i,
        kf_ptr + kv * stride_fh,
        vf_ptr + kv * stride_fh,
        k8s_ptr,
        v8s_ptr,
        posf_ptr,
        stride_ft,
        0,
        nf,
        offs_d,
        d_mask,
        qk_scale,
        False,
        True,
        BLOCK_N,
        DOT_PRECISION,
    )
    seen = l_i > 0.0
    safe_l = tl.where(seen, l_i, 1.0)
    out = acc / safe_l[:, None]
    tl.store(
        out_ptr + head * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )
    lse = tl.where(seen, m_i + tl.log2(safe_l), float("inf"))  # +inf: such a row gives no mass
    tl.store(lse_ptr + head * n_queries + offs_m, lse, mask=m_mask)


@triton.jit
def _chunk_mass_kernel(
    q_ptr,
    k_ptr,
    ks_ptr,
    qpos_ptr,
    pos_ptr,
    lse_ptr,
    mass_ptr,
    stride_qh,
    stride_qm,
    stride_kh,
    stride_kt,
    stride_sh,
    stride_st,
    stride_mh,
    n_queries,
    n_slots,
    qk_scale,
    head_dim,
    QUANT: tl.constexpr,
    CAUSAL: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block, kv = tl.program_id(0), tl.program_id(1).to(tl.int64)
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_mask = offs_n < n_slots
    d_mask = offs_d < head_dim
    k = tl.load(
        k_ptr + kv * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :],
        mask=n_mask[:, None] & d_mask[None, :],
        other=0,
    )
    k_scale = tl.full((BLOCK_N,), 1.0, dtype=tl.float32)
    if QUANT:
        k_scale = tl.load(ks_ptr + kv * stride_sh + offs_n * stride_st, mask=n_mask, other=0.0).to(tl.float32)
    if CAUSAL:
        pos = tl.load(pos_ptr + offs_n, mask=n_mask, other=_POS_NEVER)
    else:
        pos = tl.where(n_mask, -1, _POS_NEVER).to(tl.int64)  # INT8 slots are older than every query
    oldest = tl.min(pos, axis=0)
    mass = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for g in range(GROUPS):
        head = kv * GROUPS + g
        for start in range(0, n_queries, BLOCK_M):
            offs_m = start + tl.arange(0, BLOCK_M)
            m_mask = offs_m < n_queries
            q_pos = tl.load(qpos_ptr + offs_m, mask=m_mask, other=-1)
            if tl.max(q_pos, axis=0) >= oldest:
                q = tl.load(
                    q_ptr + head * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :],
                    other=0.0,
                )
                lse = tl.load(lse_ptr + head * n_queries + offs_m, mask=m_mask, other=float("inf"))
                qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
                qk = qk * (k_scale * qk_scale)[None, :]
                visible = pos[None, :] <= q_pos[:, None]
                p = tl.where(visible, tl.exp2(qk - lse[:, None]), 0.0)
                mass += tl.sum(p, axis=0)
    tl.store(mass_ptr + kv * stride_mh + offs_n, mass, mask=n_mask)


def _block_m(n_queries: int) -> int:
    return min(64, max(16, triton.next_power_of_2(n_queries)))


def chunk_attention(q, k8, k8s, v8, v8s, kf, vf, q_pos, posf, scaling: float):
    """M queries of one sequence; same contract as ``reference.chunk_attention_ref``.

    q (Hq, M, D); q_pos (M,); posf (Nf,). Returns out (Hq, M, D) in q's dtype,
    mass8 (Hkv, N8) and massf (Hkv, Nf) float32, summed over the queries and the group's heads.
    """
    q_heads, n_queries, head_dim = q.shape
    kv_heads, n8, nf = kf.shape[0], k8.shape[1], kf.shape[1]
    groups = q_heads // kv_heads
    dev = q.device
    q = q.contiguous()
    k8, v8 = _same_rows(k8, v8)
    k8s, v8s = _same_rows(k8s, v8s)
    kf, vf = _same_rows(kf.to(q.dtype), vf.to(q.dtype))
    q_pos, posf = q_pos.to(dev, torch.int64).contiguous(), posf.to(dev, torch.int64).contiguous()
    out = torch.empty_like(q)
    lse = torch.empty((q_heads, n_queries), dtype=torch.float32, device=dev)
    mass8 = torch.empty((kv_heads, n8), dtype=torch.float32, device=dev)
    massf = torch.empty((kv_heads, nf), dtype=torch.float32, device=dev)
    if n_queries == 0:
        return out, mass8.zero_(), massf.zero_()
    block_m, block_d = _block_m(n_queries), triton.next_power_of_2(head_dim)
    precision, qk_scale = _dot_precision(q.dtype), scaling * _LOG2E
    _chunk_fwd_kernel[(triton.cdiv(n_queries, block_m), q_heads)](
        q,
        k8,
        k8s,
        v8,
        v8s,
        kf,
        vf,
        q_pos,
        posf,
        out,
        lse,
        q.stride(0),
        q.stride(1),
        k8.stride(0),
        k8.stride(1),
        k8s.stride(0),
        k8s.stride(1),
        kf.stride(0),
        kf.stride(1),
        out.stride(0),
        out.stride(1),
        n_queries,
        n8,
        nf,
        qk_scale,
        head_dim,
        GROUPS=groups,
        BLOCK_M=block_m,
        BLOCK_N=_BLOCK_N,
        BLOCK_D=block_d,
        DOT_PRECISION=precision,
    )
    for keys, scales, mass, quant in ((k8, k8s, mass8, True), (kf, k8s, massf, False)):
        if keys.shape[1] == 0:
            continue
        _chunk_mass_kernel[(triton.cdiv(keys.shape[1], _BLOCK_N), kv_heads)](
            q,
            keys,
            scales,
            q_pos,
            posf,
            lse,
            mass,
            q.stride(0),
            q.stride(1),
            keys.stride(0),
            keys.stride(1),
            scales.stride(0),
            scales.stride(1) if quant else 0,
            mass.stride(0),
            n_queries,
            keys.shape[1],
            qk_scale,
            head_dim,
            QUANT=quant,
            CAUSAL=not quant,
            GROUPS=groups,
            BLOCK_M=block_m,
            BLOCK_N=_BLOCK_N,
            BLOCK_D=block_d,
            DOT_PRECISION=precision,
        )
    return out, mass8, massf
