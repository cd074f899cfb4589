"""Decode attention of a whole batch in one call per layer on the CPU (the Triton path has its
own ragged kernel): every sequence's keys and values are laid out in one padded workspace
(B, Hkv, N, D), padding masked, and one batched matmul/softmax/matmul attends all of them.

The reference is ``confkv_kernels.reference.decode_attention_ref`` (sequence by sequence, same
math); ``tests/confkv/test_batched.py`` compares the two. The workspace is reused across steps
and layers (it only grows), so a step allocates nothing that grows with the batch except the
attention probabilities themselves.
"""

from __future__ import annotations

import threading

import torch

_NEG = float("-inf")


class Workspace:
    """Reusable padded K/V buffers (float32) for one thread; grown geometrically, never shrunk."""

    def __init__(self) -> None:
        self.k = torch.empty(0)
        self.v = torch.empty(0)

    def views(self, b: int, h: int, n: int, d: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, Hkv, N, D) views of the two buffers (contents undefined)."""
        need = b * h * n * d
        if self.k.numel() < need or self.k.device != torch.device(device):
            size = max(need, 2 * self.k.numel())
            self.k = torch.empty(size, dtype=torch.float32, device=device)
            self.v = torch.empty(size, dtype=torch.float32, device=device)
        return self.k[:need].view(b, h, n, d), self.v[:need].view(b, h, n, d)


_LOCAL = threading.local()


def workspace() -> Workspace:
    ws = getattr(_LOCAL, "ws", None)
    if ws is None:
        ws = _LOCAL.ws = Workspace()
    return ws


def _fill(dst: torch.Tensor, x8: torch.Tensor, scale: torch.Tensor, xf: torch.Tensor) -> None:
    """dst (Hkv, >=N8+Nf, D) <- dequantized INT8 slots then FP slots (the reference ``_join`` order)."""
    n8, nf = x8.shape[1], xf.shape[1]
    if n8:
        part = dst[:, :n8]
        part.copy_(x8)
        part.mul_(scale.float().unsqueeze(-1))
    if nf:
        dst[:, n8 : n8 + nf].copy_(xf)


def padded_decode_attention(
    q: torch.Tensor, views: list[tuple[torch.Tensor, ...]], scaling: float
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """q (B, Hq, D), one query per sequence; ``views[b]`` = (k8, k8s, v8, v8s, kf, vf) of sequence
    b (``LayerStore.kv_views`` layout). -> out (B, Hq, D) in q's dtype, and per sequence
    (mass8 (N8,), massf (Nf,)) float32: probabilities summed over all query heads (what the EMA
    of ``SequenceCache.after_attention`` takes; the reference's (Hkv, N) summed over heads)."""
    b, hq, d = q.shape
    hkv = views[0][4].shape[0]
    groups = hq // hkv
    lengths = [v[0].shape[1] + v[4].shape[1] for v in views]
    n = max(lengths)
    keys, vals = workspace().views(b, hkv, n, d, q.device)
    for row, (k8, k8s, v8, v8s, kf, vf) in enumerate(views):
        _fill(keys[row], k8, k8s, kf)
        _fill(vals[row], v8, v8s, vf)
        if lengths[row] < n:  # padding holds stale values: 0 * NaN must not leak into the output
            vals[row, :, lengths[row] :].zero_()
    qg = q.float().reshape(b, hkv, groups, d)  # (B, Hkv, G, D)
    logits = torch.matmul(qg, keys.transpose(2, 3)).mul_(scaling)  # (B, Hkv, G, N)
    if min(lengths) < n:
        pad = torch.arange(n, device=q.device) >= torch.tensor(lengths, device=q.device).unsqueeze(1)
        logits.masked_fill_(pad.view(b, 1, 1, n), _NEG)
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs, vals).view(b, hq, d).to(q.dtype)
    mass = probs.sum(dim=(1, 2))  # (B, N)
    per_seq = []
    for row, view in enumerate(views):
        n8 = view[0].shape[1]
        per_seq.append((mass[row, :n8], mass[row, n8 : lengths[row]]))
    return out, per_seq
