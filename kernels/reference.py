"""Pure-PyTorch reference of the Conf-KV attention kernels; also the CPU path.

Storage layout (one layer):
  k8, v8      (Hkv, N8, D) int8      older tokens, symmetric per-(head, token) quantization
  k8s, v8s    (Hkv, N8)    float16   scales: x ~= x8 * scale
  kf, vf      (Hkv, Nf, D) float     recent window in the model dtype
Slots are unordered (eviction fills holes from the end); causality inside a prefill chunk is
decided from token positions, never from slot order.

Ragged batches (decode) concatenate sequences along the token axis; sequence b owns
int8 slots offsets8[b]:offsets8[b+1] and FP slots offsetsf[b]:offsetsf[b+1].
Attention mass = softmax probabilities summed over the query heads of each KV head (GQA) and over
the queries of a chunk: shape (Hkv, N8) and (Hkv, Nf), float32.
"""

from __future__ import annotations

import torch

_QMAX = 127.0
_MIN_SCALE = 1e-6


def quantize_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (Hkv, N, D) float -> (x8 (Hkv, N, D) int8, scale (Hkv, N) float16)."""
    amax = x.detach().abs().amax(dim=-1).float()
    scale = (amax / _QMAX).clamp_min(_MIN_SCALE).to(torch.float16)
    x8 = torch.round(x.float() / scale.float().unsqueeze(-1)).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return x8, scale


def dequantize_int8_ref(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(Hkv, N, D) int8 x (Hkv, N) float16 -> (Hkv, N, D) in ``dtype``."""
    return (x8.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)).to(dtype)


def _join(x8, scale, xf, work):
    """Dequantized INT8 slots followed by FP slots; no copy when the INT8 part is empty."""
    if x8.shape[1] == 0:
        return xf.to(work)
    return torch.cat([dequantize_int8_ref(x8, scale, work), xf.to(work)], dim=1)


def _attend_one(q, k8, k8s, v8, v8s, kf, vf, scaling, q_pos=None, posf=None):
    """q (Hq, M, D) against one sequence's keys -> out (Hq, M, D), mass8 (Hkv, N8), massf (Hkv, Nf)."""
    hq, m, d = q.shape
    hkv = kf.shape[0]
    groups = hq // hkv
    work = torch.float32
    keys = _join(k8, k8s, kf, work)  # (Hkv, N, D)
    vals = _join(v8, v8s, vf, work)
    qg = q.to(work).reshape(hkv, groups * m, d)  # (Hkv, G*M, D)
    logits = torch.bmm(qg, keys.transpose(1, 2)) * scaling  # (Hkv, G*M, N)
    if q_pos is not None:
        n8 = k8.shape[1]
        visible = posf.view(1, -1) <= q_pos.view(-1, 1)  # (M, Nf)
        mask = torch.ones(m, n8 + kf.shape[1], dtype=torch.bool, device=q.device)
        mask[:, n8:] = visible
        logits = logits.view(hkv, groups, m, -1).masked_fill(~mask, float("-inf")).view(hkv, groups * m, -1)
    probs = torch.softmax(logits, dim=-1)
    out = torch.bmm(probs, vals).reshape(hq, m, d).to(q.dtype)
    mass = probs.sum(dim=1)  # (Hkv, N)
    n8 = k8.shape[1]
    return out, mass[:, :n8], mass[:, n8:]


def decode_attention_ref(q, k8, k8s, v8, v8s, kf, vf, offsets8, offsetsf, scaling: float):
    """One query token per sequence.

    q (B, Hq, D); storage as in the module docstring; offsets (B+1,) int.
    Returns out (B, Hq, D) in q's dtype, mass8 (Hkv, N8) and massf (Hkv, Nf) float32.
    """
    batch = q.shape[0]
    if batch == 1:  # the CPU worker's common case: no slicing, no scatter
        out, m8, mf = _attend_one(q[0].unsqueeze(1), k8, k8s, v8, v8s, kf, vf, scaling)
        return out.transpose(0, 1), m8, mf
    outs = []
    mass8 = torch.zeros(k8.shape[0], k8.shape[1], dtype=torch.float32, device=q.device)
    massf = torch.zeros(kf.shape[0], kf.shape[1], dtype=torch.float32, device=q.device)
    o8, of = offsets8.tolist(), offsetsf.tolist()
    for b in range(batch):
        a8, e8, af, ef = o8[b], o8[b + 1], of[b], of[b + 1]
        out, m8, mf = _attend_one(
            q[b].unsqueeze(1),
            k8[:, a8:e8],
            k8s[:, a8:e8],
            v8[:, a8:e8],
            v8s[:, a8:e8],
            kf[:, af:ef],
            vf[:, af:ef],
            scaling,
        )
        outs.append(out.squeeze(1))
        mass8[:, a8:e8] = m8
        massf[:, af:ef] = mf
    return torch.stack(outs), mass8, massf


def chunk_attention_ref(q, k8, k8s, v8, v8s, kf, vf, q_pos, posf, scaling: float):
    """A chunk of M queries of one sequence (prefill); causal by position.

    q (Hq, M, D); q_pos (M,) positions of the queries; posf (Nf,) positions of the FP slots.
    Every INT8 token is older than every query (only FP tokens can be in the chunk).
    Returns out (Hq, M, D), mass8 (Hkv, N8), massf (Hkv, Nf) summed over queries and heads.
    """
    return _attend_one(q, k8, k8s, v8, v8s, kf, vf, scaling, q_pos=q_pos, posf=posf)
