"""Eviction of a decode batch in one call per layer (the CPU batched step).

The members of a ``confkv.arena.DecodeArena`` that must evict at a layer in the same step (with
``slack=0`` every member at its budget does, every step) are scored by their policy over rows
(``CachePolicy.score`` on (R, N) statistics with a ``valid`` mask), selected by one
``select_rows`` and compacted together: a few tensor ops per layer instead of a score, a
selection and a compaction per member.

Each member ends bit for bit where ``SequenceCache.evict_to`` leaves it alone: the same scores
(every reduction is per row, over live slots), the same kept set (one tie rule, a stable sort)
and the same slot layout (holes below the new count filled, in order, from the kept slots above
it, as ``_Part.keep`` does); the freed slots' statistics are zeroed like ``_Part._shrink``'s.
"""

from __future__ import annotations

import torch

from confkv.policies import CachePolicy, TokenStats
from confkv.policies.select import select_rows
from confkv.sequence import SequenceCache

_ZEROED = ("ema", "cum", "pin")


def evict_rows(
    tensors: dict[str, torch.Tensor], seqs: list[SequenceCache], rows: list[int], keeps: list[int], layer: int
) -> None:
    """Evict ``seqs[i]`` (the member in row ``rows[i]`` of the arena layer ``tensors``: k, v
    (B, Hkv, cap, D), pos, ema, cum, pin (B, cap)) down to ``keeps[i]`` tokens of ``layer``.
    All members share one policy; each is FP only (``SequenceCache.evicts_by_rows``)."""
    policy: CachePolicy = seqs[0].policy
    stores = [s.stores[layer] for s in seqs]
    lengths = [st.fp.n for st in stores]
    n = max(lengths)
    index = torch.tensor(rows)
    length = torch.tensor(lengths)
    valid = None if min(lengths) == n else torch.arange(n) < length.unsqueeze(1)
    every = rows == list(range(tensors["pos"].shape[0]))  # the whole batch: read rows in place
    meta = {
        name: tensors[name].narrow(1, 0, n) if every else tensors[name][index, :n]
        for name in ("pos", "ema", "cum")
    }  # (R, N), read before the compaction below rewrites the rows
    now = torch.tensor([st.next_pos for st in stores]).unsqueeze(1)
    stats = TokenStats(meta["pos"], meta["ema"], meta["cum"], now, None, valid)
    scores = policy.score(stats)
    mask = select_rows(scores, meta["pos"], torch.tensor(keeps), now - policy.protected, policy.s, valid)
    kept = _compact(tensors, index, mask, valid)
    for seq, store, before, after in zip(seqs, stores, lengths, kept, strict=True):
        store.fp.n = after
        seq.count_evicted(layer, before - after)


def _compact(
    tensors: dict[str, torch.Tensor], index: torch.Tensor, mask: torch.Tensor, valid: torch.Tensor | None
) -> list[int]:
    """Keep each row's slots where ``mask`` (R, N); -> the new live counts. Row r's holes below
    its new count take, in order, its kept slots at or above it; the freed slots' statistics
    are zeroed. Every copy is one ``index_select``/``index_copy_`` on a flat view of a tensor
    (the arena's tensors are contiguous: row b, head h, slot c is flat row (b*H + h)*cap + c)."""
    n = mask.shape[1]
    cap = tensors["pos"].shape[1]
    new_n = mask.sum(1)
    cut = torch.arange(n) >= new_n.unsqueeze(1)  # (R, N) at or past the new count
    hole_r, hole_c = (~mask & ~cut).nonzero(as_tuple=True)
    _, src_c = (mask & cut).nonzero(as_tuple=True)  # row-major: pairs with the holes row by row
    if hole_c.numel():
        row = index[hole_r] * cap
        dst, src = row + hole_c, row + src_c  # flat slots of (B, cap) metadata
        heads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for tensor in tensors.values():
            if tensor.dim() == 2:
                flat, to, frm = tensor.view(-1), dst, src
            else:  # (B, Hkv, cap, D) keys and values
                h = tensor.shape[1]
                if h not in heads:
                    shift = (index[hole_r] * ((h - 1) * cap)).unsqueeze(1) + torch.arange(h) * cap
                    heads[h] = ((dst.unsqueeze(1) + shift).view(-1), (src.unsqueeze(1) + shift).view(-1))
                flat, (to, frm) = tensor.view(-1, tensor.shape[3]), heads[h]
            flat.index_copy_(0, to, flat.index_select(0, frm))
    freed = cut if valid is None else cut & valid
    free_r, free_c = freed.nonzero(as_tuple=True)
    if free_c.numel():
        slots = index[free_r] * cap + free_c
        for name in _ZEROED:
            tensors[name].view(-1).index_fill_(0, slots, 0)
    return new_n.tolist()
