"""Triton decode attention over the INT8 tail + FP window, split-K (flash-decoding) with GQA.

Pass 1 ``_decode_partial_kernel``, grid (B, Hkv, S): one program owns one sequence, one KV head
and 1/S of that sequence's INT8 slots plus 1/S of its FP slots. All G = Hq/Hkv query heads of
the KV head are the rows of one ``tl.dot`` (padded to 16), so each key byte is read once for the
whole group. INT8 keys are dotted as exact small integers and the per-token key scale is applied
to the logits; the value scale is folded into the probabilities. Nothing is dequantized in memory.
It writes an unnormalized partial (acc, running max, running sum) per (sequence, head, split) and
the raw base-2 logits of every key it visited, (Hq, N) float32.

Pass 2 ``_decode_finish_kernel``, same grid: merges the S partial (max, sum) pairs of its heads,
normalizes the stored logits of its own slots into attention mass summed over the group
(``exp2(logit - max) / sum``) and, on split 0, merges the S partial outputs. It never reads the
keys again: the logits cost 4 B per (query head, slot), written once and read once, i.e. 24 B per
slot and KV head next to 128 B of INT8 K+V at G=3, D=64 (+19%), 32 B next to 256 B at G=4, D=128.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_BLOCK_N = 64  # slots per block; the split-K factor is a runtime argument (no recompiles as contexts grow)


@triton.jit
def _split_bounds(start, end, split, num_splits, BLOCK_N: tl.constexpr):
    """Slots [lo, hi) of ``split`` within [start, end): whole blocks, the last splits may get less."""
    per_split = tl.cdiv(tl.cdiv(end - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, end)
    return lo, hi


@triton.jit
def _decode_segment(
    q,
    acc,
    m_i,
    l_i,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    logit_ptr,
    stride_kt,
    stride_vt,
    stride_st,
    stride_lh,
    lo,
    hi,
    offs_g,
    g_mask,
    offs_d,
    d_mask,
    qk_scale,
    QUANT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax of the G query rows ``q`` over slots [lo, hi) of one KV head.

    Pointers are already offset to the KV head; logits go to rows ``offs_g`` of ``logit_ptr``.
    """
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + offs_n[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)  # (G, N) fp32
        if QUANT:
            k_scale = tl.load(ks_ptr + offs_n * stride_st, mask=n_mask, other=0.0).to(tl.float32)
            qk = qk * k_scale[None, :]
        qk = tl.where(n_mask[None, :], qk * qk_scale, float("-inf"))
        tl.store(
            logit_ptr + offs_g[:, None] * stride_lh + offs_n[None, :],
            qk,
            mask=g_mask[:, None] & n_mask[None, :],
        )
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + offs_n[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0)
        if QUANT:
            v_scale = tl.load(vs_ptr + offs_n * stride_st, mask=n_mask, other=0.0).to(tl.float32)
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _decode_partial_kernel(
    q_ptr,
    k8_ptr,
    k8s_ptr,
    v8_ptr,
    v8s_ptr,
    kf_ptr,
    vf_ptr,
    off8_ptr,
    offf_ptr,
    logit8_ptr,
    logitf_ptr,
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    stride_qb,
    stride_qh,
    stride_k8h,
    stride_k8t,
    stride_v8h,
    stride_v8t,
    stride_s8h,
    stride_s8t,
    stride_kfh,
    stride_kft,
    stride_vfh,
    stride_vft,
    stride_l8h,
    stride_lfh,
    qk_scale,
    head_dim,
    num_splits,
    GROUPS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq, head, split = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)  # int64: big caches
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUPS
    d_mask = offs_d < head_dim
    q_heads = head * GROUPS + offs_g
    q = tl.load(
        q_ptr + seq * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # (G, D)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)

    lo, hi = _split_bounds(tl.load(off8_ptr + seq), tl.load(off8_ptr + seq + 1), split, num_splits, BLOCK_N)
    acc, m_i, l_i = _decode_segment(
        q,
        acc,
        m_i,
        l_i,
        k8_ptr + head * stride_k8h,
        v8_ptr + head * stride_v8h,
        k8s_ptr + head * stride_s8h,
        v8s_ptr + head * stride_s8h,
        logit8_ptr + head * GROUPS * stride_l8h,
        stride_k8t,
        stride_v8t,
        stride_s8t,
        stride_l8h,
        lo,
        hi,
        offs_g,
        g_mask,
        offs_d,
        d_mask,
        qk_scale,
        True,
        BLOCK_N,
        DOT_PRECISION,
    )
    lo, hi = _split_bounds(tl.load(offf_ptr + seq), tl.load(offf_ptr + seq + 1), split, num_splits, BLOCK_N)
    acc, m_i, l_i = _decode_segment(
        q,
        acc,
        m_i,
        l_i,
        kf_ptr + head * stride_kfh,
        vf_ptr + head * stride_vfh,
        k8s_ptr,
        v8s_ptr,
        logitf_ptr + head * GROUPS * stride_lfh,
        stride_kft,
        stride_vft,
        0,
        stride_lfh,
        lo,
        hi,
        offs_g,
        g_mask,
        offs_d,
        d_mask,
        qk_scale,
        False,
        BLOCK_N,
        DOT_PRECISION,
    )
    part = (seq * tl.num_programs(1) * GROUPS + q_heads) * num_splits + split  # (G,) row of (B, Hq, S)
    tl.store(part_o_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_mask[:, None])
    tl.store(part_m_ptr + part, m_i, mask=g_mask)
    tl.store(part_l_ptr + part, l_i, mask=g_mask)


@triton.jit
def _mass_segment(
    logit_ptr, mass_ptr, stride_lh, stride_mh, lo, hi, offs_g, g_mask, m_fin, inv_l, BLOCK_N: tl.constexpr
):
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        logits = tl.load(
            logit_ptr + offs_g[:, None] * stride_lh + offs_n[None, :],
            mask=g_mask[:, None] & n_mask[None, :],
            other=float("-inf"),
        )
        probs = tl.exp2(logits - m_fin[:, None]) * inv_l[:, None]
        tl.store(mass_ptr + offs_n, tl.sum(probs, axis=0), mask=n_mask)


@triton.jit
def _decode_finish_kernel(
    off8_ptr,
    offf_ptr,
    logit8_ptr,
    logitf_ptr,
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    mass8_ptr,
    massf_ptr,
    stride_ob,
    stride_oh,
    stride_l8h,
    stride_lfh,
    stride_m8h,
    stride_mfh,
    head_dim,
    num_splits,
    GROUPS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq, head, split = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_s = tl.arange(0, BLOCK_S)
    g_mask = offs_g < GROUPS
    q_heads = head * GROUPS + offs_g
    rows = (seq * tl.num_programs(1) * GROUPS + q_heads) * num_splits  # (G,) first split of each head
    gs_mask = g_mask[:, None] & (offs_s[None, :] < num_splits)
    part_m = tl.load(part_m_ptr + rows[:, None] + offs_s[None, :], mask=gs_mask, other=float("-inf"))
    part_l = tl.load(part_l_ptr + rows[:, None] + offs_s[None, :], mask=gs_mask, other=0.0)
    m_fin = tl.max(part_m, axis=1)
    m_fin = tl.where(m_fin == float("-inf"), 0.0, m_fin)  # a sequence with no slots at all
    weights = tl.exp2(part_m - m_fin[:, None])  # (G, S)
    l_fin = tl.sum(part_l * weights, axis=1)
    inv_l = tl.where(l_fin > 0.0, 1.0 / tl.where(l_fin > 0.0, l_fin, 1.0), 0.0)

    lo, hi = _split_bounds(tl.load(off8_ptr + seq), tl.load(off8_ptr + seq + 1), split, num_splits, BLOCK_N)
    _mass_segment(
        logit8_ptr + head * GROUPS * stride_l8h,
        mass8_ptr + head * stride_m8h,
        stride_l8h,
        stride_m8h,
        lo,
        hi,
        offs_g,
        g_mask,
        m_fin,
        inv_l,
        BLOCK_N,
    )
    lo, hi = _split_bounds(tl.load(offf_ptr + seq), tl.load(offf_ptr + seq + 1), split, num_splits, BLOCK_N)
    _mass_segment(
        logitf_ptr + head * GROUPS * stride_lfh,
        massf_ptr + head * stride_mfh,
        stride_lfh,
        stride_mfh,
        lo,
        hi,
        offs_g,
        g_mask,
        m_fin,
        inv_l,
        BLOCK_N,
    )

    if split == 0:
        offs_d = tl.arange(0, BLOCK_D)
        acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
        for s in range(num_splits):
            part_o = tl.load(
                part_o_ptr + (rows + s)[:, None] * BLOCK_D + offs_d[None, :], mask=g_mask[:, None], other=0.0
            )
            w = tl.sum(tl.where(offs_s[None, :] == s, weights, 0.0), axis=1)
            acc += part_o * w[:, None]
        out = acc * inv_l[:, None]
        tl.store(
            out_ptr + seq * stride_ob + q_heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & (offs_d[None, :] < head_dim),
        )


def _same_rows(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Views of a bigger cache buffer are fine (no copy) if rows are unit-stride and layouts agree."""
    if all(t.stride() == tensors[0].stride() and t.stride(-1) == 1 for t in tensors):
        return tensors
    return tuple(t.contiguous() for t in tensors)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 models ask for fp32 accuracy: TF32 would cost ~1e-3 relative error in the logits.
    return "ieee" if dtype == torch.float32 else "tf32"


def _default_splits(batch: int, kv_heads: int, n_slots: int, device: torch.device) -> int:
    """Enough (sequence, head, split) programs to fill the GPU, each with >= 4 blocks of work."""
    if device.type != "cuda":
        return 1
    programs_wanted = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    per_seq_blocks = triton.cdiv(max(n_slots // max(batch, 1), 1), 4 * _BLOCK_N)
    splits = min(triton.cdiv(programs_wanted, batch * kv_heads), per_seq_blocks, 64)
    return max(splits, 1)


def decode_attention(q, k8, k8s, v8, v8s, kf, vf, offsets8, offsetsf, scaling: float, num_splits=None):
    """One query token per sequence; same contract as ``reference.decode_attention_ref``.

    q (B, Hq, D); k8/v8 (Hkv, N8, D) int8; k8s/v8s (Hkv, N8) fp16; kf/vf (Hkv, Nf, D);
    offsets (B+1,). Returns out (B, Hq, D) in q's dtype, mass8 (Hkv, N8), massf (Hkv, Nf) float32.
    ``num_splits`` (split-K factor) defaults to a heuristic that fills the GPU.
    """
    batch, q_heads, head_dim = q.shape
    kv_heads, n8, nf = kf.shape[0], k8.shape[1], kf.shape[1]
    groups = q_heads // kv_heads
    splits = num_splits or _default_splits(batch, kv_heads, n8 + nf, q.device)
    dev = q.device
    q = q.contiguous()
    (k8,), (v8,), (k8s, v8s) = _same_rows(k8), _same_rows(v8), _same_rows(k8s, v8s)
    (kf,), (vf,) = _same_rows(kf.to(q.dtype)), _same_rows(vf.to(q.dtype))
    offsets8, offsetsf = offsets8.to(dev, torch.int32), offsetsf.to(dev, torch.int32)
    out = torch.empty_like(q)
    mass8 = torch.zeros((kv_heads, n8), dtype=torch.float32, device=dev)
    massf = torch.zeros((kv_heads, nf), dtype=torch.float32, device=dev)
    logit8 = torch.empty((q_heads, n8), dtype=torch.float32, device=dev)
    logitf = torch.empty((q_heads, nf), dtype=torch.float32, device=dev)
    block_d = triton.next_power_of_2(head_dim)
    part_o = torch.empty((batch, q_heads, splits, block_d), dtype=torch.float32, device=dev)
    part_m = torch.empty((batch, q_heads, splits), dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    grid = (batch, kv_heads, splits)
    block_g = max(16, triton.next_power_of_2(groups))
    _decode_partial_kernel[grid](
        q,
        k8,
        k8s,
        v8,
        v8s,
        kf,
        vf,
        offsets8,
        offsetsf,
        logit8,
        logitf,
        part_o,
        part_m,
        part_l,
        q.stride(0),
        q.stride(1),
        k8.stride(0),
        k8.stride(1),
        v8.stride(0),
        v8.stride(1),
        k8s.stride(0),
        k8s.stride(1),
        kf.stride(0),
        kf.stride(1),
        vf.stride(0),
        vf.stride(1),
        logit8.stride(0),
        logitf.stride(0),
        scaling * _LOG2E,
        head_dim,
        splits,
        GROUPS=groups,
        BLOCK_G=block_g,
        BLOCK_N=_BLOCK_N,
        BLOCK_D=block_d,
        DOT_PRECISION=_dot_precision(q.dtype),
    )
    _decode_finish_kernel[grid](
        offsets8,
        offsetsf,
        logit8,
        logitf,
        part_o,
        part_m,
        part_l,
        out,
        mass8,
        massf,
        out.stride(0),
        out.stride(1),
        logit8.stride(0),
        logitf.stride(0),
        mass8.stride(0),
        massf.stride(0),
        head_dim,
        splits,
        GROUPS=groups,
        BLOCK_G=block_g,
        BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_N=_BLOCK_N,
        BLOCK_D=block_d,
    )
    return out, mass8, massf
