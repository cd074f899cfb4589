"""Pure-PyTorch reference of the recall-tier ops; also the CPU path.

Cold-tier layout (one sequence, one layer), pages aligned to positions (page p of size S holds
positions p*S .. p*S+S-1, each token at offset pos % S):
  k8, v8      (P, Hkv, S, D) int8     payload (exactly the hot tier's INT8 bytes)
  ks, vs      (P, Hkv, S)    float16  per-(head, token) scales
  valid       (P, S)         bool     offset holds a cold token
Page summary (kept on the device, counted as hot bytes), Quest-style key bounds:
  lo8, hi8    (P, Hkv, D)    int8     lo8 * sscale <= every valid key <= hi8 * sscale (per dim)
  sscale      (P, Hkv)       float16
Upper bound of q.k over a page (per query head h, kv head g = h // (Hq // Hkv)):
  ub = sum_d max(q_d * lo_d, q_d * hi_d) = relu(q) . hi + min(q, 0) . lo     (two matmuls)
"""

from __future__ import annotations

import torch

_QMAX = 127.0
_MIN_SCALE = 1e-6


def _round_scale_up(scale: torch.Tensor) -> torch.Tensor:
    """float32 -> float16 never smaller than the input (so |x| / scale16 <= 127 stays true)."""
    s16 = scale.to(torch.float16)
    low = s16.float() < scale
    if bool(low.any()):
        s16 = torch.where(low, torch.nextafter(s16, torch.full_like(s16, float("inf"))), s16)
    return s16


def summarize_pages_ref(
    k8: torch.Tensor, ks: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k8 (P, Hkv, S, D) int8, ks (P, Hkv, S) f16, valid (P, S) -> lo8, hi8 (P, Hkv, D) int8, sscale
    (P, Hkv) f16, rounded outward so that lo8*sscale <= k <= hi8*sscale for every valid key k.
    Empty pages get lo = hi = 0."""
    keys = k8.float() * ks.float().unsqueeze(-1)  # (P, Hkv, S, D) exact: int8 x f16 fits f32
    m = valid[:, None, :, None]
    lo = keys.masked_fill(~m, float("inf")).amin(2)
    hi = keys.masked_fill(~m, float("-inf")).amax(2)
    empty = ~valid.any(1)[:, None, None]
    return quantize_bounds_ref(lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0))


def quantize_bounds_ref(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Float bounds lo, hi (P, Hkv, D) -> lo8, hi8 (P, Hkv, D) int8, sscale (P, Hkv) f16, rounded
    outward: lo8*sscale <= lo and hi <= hi8*sscale."""
    amax = torch.maximum(lo.abs(), hi.abs()).amax(-1)  # (P, Hkv)
    scale = _round_scale_up((amax / _QMAX).clamp_min(_MIN_SCALE))
    s = scale.float().unsqueeze(-1)
    lo_q = torch.floor(lo / s)
    lo_q = torch.where(lo_q * s > lo, lo_q - 1, lo_q)  # division rounding must never raise lo
    hi_q = torch.ceil(hi / s)
    hi_q = torch.where(hi_q * s < hi, hi_q + 1, hi_q)
    lo8 = lo_q.clamp(-128, 127).to(torch.int8)
    hi8 = hi_q.clamp(-128, 127).to(torch.int8)
    return lo8, hi8, scale


def page_scores_ref(
    q: torch.Tensor,
    lo8: torch.Tensor,
    hi8: torch.Tensor,
    sscale: torch.Tensor,
    lse: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Upper bound of the log attention weight any key of a page could get, relative to the hot set.

    q (Hq, M, D) queries (after RoPE); lo8/hi8 (P, Hkv, D), sscale (P, Hkv); lse (Hq, M) float32
    log-sum-exp of the hot logits of each query -> (P,) float32:
      max over query heads h and queries i of  scaling * ub(q[h, i], page) - lse[h, i].
    """
    hq, m, d = q.shape
    p, hkv, _ = lo8.shape
    if p == 0:
        return torch.zeros(0, dtype=torch.float32, device=q.device)
    groups = hq // hkv
    qg = q.float().reshape(hkv, groups * m, d)  # (Hkv, G*M, D)
    s = sscale.float().unsqueeze(-1)
    lo = (lo8.float() * s).permute(1, 2, 0)  # (Hkv, D, P)
    hi = (hi8.float() * s).permute(1, 2, 0)
    ub = torch.bmm(qg.clamp_min(0), hi) + torch.bmm(qg.clamp_max(0), lo)  # (Hkv, G*M, P)
    rel = ub * scaling - lse.float().reshape(hkv, groups * m, 1)
    return rel.amax(dim=1).amax(dim=0)


def gather_pages_ref(
    k8: torch.Tensor,
    v8: torch.Tensor,
    ks: torch.Tensor,
    vs: torch.Tensor,
    valid: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compact the valid tokens of pages ``slots`` (R,) into the hot layout.

    -> k8 (Hkv, n, D), v8 (Hkv, n, D), ks (Hkv, n), vs (Hkv, n), flat (n,) int64 where
    flat = slot * S + offset of each gathered token (page-major, offset order)."""
    s = valid.shape[1]
    sel = valid.index_select(0, slots)  # (R, S)
    r_idx, off = sel.nonzero(as_tuple=True)
    page = slots[r_idx]
    k = k8[page, :, off].transpose(0, 1)  # (Hkv, n, D)
    v = v8[page, :, off].transpose(0, 1)
    kss = ks[page, :, off].transpose(0, 1)  # (Hkv, n)
    vss = vs[page, :, off].transpose(0, 1)
    return k, v, kss, vss, page * s + off


def scatter_pages_ref(
    k8: torch.Tensor,
    v8: torch.Tensor,
    ks: torch.Tensor,
    vs: torch.Tensor,
    valid: torch.Tensor,
    slot: torch.Tensor,
    offset: torch.Tensor,
    tk8: torch.Tensor,
    tv8: torch.Tensor,
    tks: torch.Tensor,
    tvs: torch.Tensor,
) -> None:
    """In place: write tokens tk8/tv8 (Hkv, n, D) int8, tks/tvs (Hkv, n) f16 to pages ``slot`` (n,)
    at ``offset`` (n,) and mark them valid."""
    k8[slot, :, offset] = tk8.transpose(0, 1)
    v8[slot, :, offset] = tv8.transpose(0, 1)
    ks[slot, :, offset] = tks.transpose(0, 1)
    vs[slot, :, offset] = tvs.transpose(0, 1)
    valid[slot, offset] = True
