"""Decode attention of a whole batch in one call per layer on the CPU (the Triton path has its
own ragged kernel): every sequence's keys and values are laid out in one padded workspace
(B, Hkv, N, D), padding masked, and one batched matmul/softmax/matmul attends all of them.

The reference is ``confkv_kernels.reference.decode_attention_ref`` (sequence by sequence, same
math); ``tests/confkv/test_batched.py`` compares the two. The workspace is reused across steps
and layers (it only grows), so a step allocates nothing that grows with the batch except the
attention probabilities themselves. A decode batch whose FP windows are rows of one
``confkv.arena.DecodeArena`` (continuous batching in the worker) skips the workspace and attends
over the rows in place; this path serves every other batch (INT8 slots, recall tiers, mixed ways
of attending, lengths too uneven to share rows).
"""

from __future__ import annotations

import itertools
import threading

import torch

from confkv.cache import ConfKVCache, all_or_nothing, driven
from confkv.sequence import SequenceCache

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
        part = dst.narrow(1, 0, n8)
        part.copy_(x8)
        part.mul_(scale.float().unsqueeze(-1))
    if nf:
        dst.narrow(1, n8, nf).copy_(xf)


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
    rows = zip(keys.unbind(0), vals.unbind(0), views, lengths, strict=True)
    for krow, vrow, (k8, k8s, v8, v8s, kf, vf), length in rows:
        _fill(krow, k8, k8s, kf)
        _fill(vrow, v8, v8s, vf)
        if length < n:  # padding holds stale values: 0 * NaN must not leak into the output
            vrow.narrow(1, length, n - length).zero_()
    qg = q.float().reshape(b, hkv, groups, d)  # (B, Hkv, G, D)
    logits = torch.matmul(qg, keys.transpose(2, 3)).mul_(scaling)  # (B, Hkv, G, N)
    if min(lengths) < n:
        pad = torch.arange(n, device=q.device) >= torch.tensor(lengths, device=q.device).unsqueeze(1)
        logits.masked_fill_(pad.view(b, 1, 1, n), _NEG)
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs, vals).view(b, hq, d).to(q.dtype)
    mass = probs.sum(dim=(1, 2))  # (B, N)
    per_seq = []
    none = mass.new_empty(0)
    for mrow, view, length in zip(mass.unbind(0), views, lengths, strict=True):
        n8 = view[0].shape[1]
        per_seq.append((mrow[:n8], mrow[n8:length]) if n8 else (none, mrow.narrow(0, 0, length)))
    return out, per_seq


def fold_attention(
    seqs: list[SequenceCache], layer: int, masses: list[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """``after_attention`` for a batch: every sequence's EMA and cumulative attention updated by
    three ``_foreach`` calls per distinct decay (the same elementwise ops as
    ``LayerStore.add_attention``, so bit for bit), then each sequence settles (eviction, demotion)."""
    groups: dict[float, tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]] = {}
    for seq, (m8, mf) in zip(seqs, masses, strict=True):
        if not seq.policy.needs_attention:
            continue
        emas, cums, adds = groups.setdefault(seq.policy.decay, ([], [], []))
        store = seq.stores[layer]
        for part, mass in ((store.q, m8), (store.fp, mf)):
            if part.n:
                emas.append(part.view("ema"))
                cums.append(part.view("cum"))
                adds.append(mass)
    for decay, (emas, cums, adds) in groups.items():
        torch._foreach_mul_(emas, decay)
        torch._foreach_add_(emas, adds, alpha=1 - decay)
        torch._foreach_add_(cums, adds)
    for seq in seqs:
        seq.settle(layer)


# -- packed steps: prefill chunks and decode tokens of many sequences in one forward -----------------
class PackedCache(ConfKVCache):
    """Several sequences' new tokens packed along ONE batch row (vLLM-style chunked prefill mixed
    with decode): sequence b owns tokens ``offsets[b]:offsets[b + 1]`` of the forward. Each
    sequence evicts and appends its own slice exactly as it would alone."""

    packed = True

    def __init__(self, sequences: list[SequenceCache], lengths: list[int]):
        super().__init__(sequences)
        if len(lengths) != len(sequences) or min(lengths) < 1:
            raise ValueError(f"one positive token count per sequence, got {lengths}")
        self.lengths = list(lengths)
        self.offsets = [0, *itertools.accumulate(lengths)]

    def store(self, key_states, value_states, layer_idx: int) -> None:
        """key/value (1, Hkv, T, D) with T = sum(lengths)."""
        if key_states.shape[0] != 1 or key_states.shape[2] != self.offsets[-1]:
            raise ValueError(f"a packed forward has one row of {self.offsets[-1]} tokens")
        for b, seq in enumerate(self.seqs):
            start, end = self.offsets[b], self.offsets[b + 1]
            seq.before_append(layer_idx, end - start)
            seq.append(layer_idx, key_states[0, :, start:end], value_states[0, :, start:end])


def packed_attention(
    cache: PackedCache, layer: int, query: torch.Tensor, scaling: float, attend_one, attend_decode
) -> torch.Tensor:
    """query (1, Hq, T, D) -> (1, Hq, T, D): the one-token sequences (decode) in one padded call,
    each prompt chunk by the chunk path; ``attend_one``/``attend_decode`` are the attention
    function's per-sequence and batched-decode entry points (they update the statistics)."""
    q = query[0]  # (Hq, T, D)
    out = torch.empty_like(q)
    single = [b for b, m in enumerate(cache.lengths) if m == 1]
    if single:
        cols = torch.tensor([cache.offsets[b] for b in single], device=q.device)
        qd = q.index_select(1, cols).transpose(0, 1).unsqueeze(2)  # (Bd, Hq, 1, D)
        seqs = [cache.seqs[b] for b in single]
        od = (
            attend_decode(seqs, layer, qd, scaling)
            if len(seqs) > 1
            else attend_one(seqs[0], layer, qd[0], scaling)[None]
        )
        out.index_copy_(1, cols, od[:, :, 0].transpose(0, 1))
    for b, seq in enumerate(cache.seqs):
        start, end = cache.offsets[b], cache.offsets[b + 1]
        if end - start > 1:
            out[:, start:end] = attend_one(seq, layer, q[:, start:end], scaling)
    return out.unsqueeze(0)


@torch.no_grad()
def packed_forward(model, seqs: list[SequenceCache], chunks: list[list[int]]) -> torch.Tensor:
    """Feed ``chunks[b]`` (token ids, >= 1) to sequence b, all in one forward. -> logits (B, V) of
    each sequence's last fed token. Budgets are not updated (callers observe the logits they use)."""
    lengths = [len(c) for c in chunks]
    cache = PackedCache(seqs, lengths)
    device = next(model.parameters()).device
    ids = torch.tensor([[t for c in chunks for t in c]], device=device)
    positions = torch.cat(
        [torch.arange(s.seen_tokens, s.seen_tokens + m) for s, m in zip(seqs, lengths, strict=True)]
    )
    last = torch.tensor(cache.offsets[1:], device=device) - 1
    with driven(), all_or_nothing(seqs):  # the engine feeds recall prompt ends alone, through the probe
        out = model(
            input_ids=ids, position_ids=positions[None].to(device), past_key_values=cache, use_cache=True,
            logits_to_keep=last,
        )  # fmt: skip
    return out.logits[0]
