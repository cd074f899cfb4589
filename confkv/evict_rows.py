"""Eviction of a decode batch in one call per step (the CPU batched step).

When a step begins, every (member, layer) of a ``confkv.arena.DecodeArena`` that must evict
before its new token arrives (with ``slack=0`` every layer of every member at its budget does,
every step; with slack, all 30 layers of a member at once) is a row: the rows are scored by
their policy (``CachePolicy.score`` on (R, N) statistics with a ``valid`` mask), selected by one
``kept_mask`` (or, in the one-in-one-out steady state, ``one_out``) and compacted
together: a few tensor ops per step instead of a score, a selection and a compaction per member
and layer.

Each row ends bit for bit where ``SequenceCache.evict_to`` leaves it alone: the same scores
(every reduction is per row, over live slots), the same kept set (one tie rule, a stable sort)
and the same slot layout (holes below the new count filled, in order, from the kept slots above
it, as ``_Part.keep`` does); the freed slots' statistics are zeroed like ``_Part._shrink``'s.
"""

from __future__ import annotations

import torch

from confkv.policies import CachePolicy, TokenStats
from confkv.policies.select import kept_mask, one_out, rank_rows
from confkv.sequence import SequenceCache
from confkv.storage import value_l1

_ZEROED = ("ema", "cum", "pin")


def evict_rows(
    tensors: dict[str, torch.Tensor],
    seqs: list[SequenceCache],
    rows: list[int],
    keeps: list[int],
    layers: list[int],
) -> None:
    """Evict layer ``layers[i]`` of ``seqs[i]`` (row ``rows[i]`` of the arena tensors: k, v
    (R, Hkv, cap, D), pos, ema, cum, pin (R, cap), contiguous) down to ``keeps[i]`` tokens. All
    rows share one policy; each is FP only (``SequenceCache.evicts_by_rows``)."""
    policy: CachePolicy = seqs[0].policy
    stores = [s.stores[layer] for s, layer in zip(seqs, layers, strict=True)]
    lengths = [st.fp.n for st in stores]
    n = max(lengths)
    index = torch.tensor(rows)
    length = torch.tensor(lengths)
    valid = None if min(lengths) == n else torch.arange(n) < length.unsqueeze(1)
    every = rows == list(range(tensors["pos"].shape[0]))  # every row: read them in place
    meta = {
        name: tensors[name].narrow(1, 0, n) if every else tensors[name][index, :n]
        for name in ("pos", "ema", "cum")
    }  # (R, N), read before the compaction below rewrites the rows
    now = torch.tensor([st.next_pos for st in stores]).unsqueeze(1)
    stats = TokenStats(meta["pos"], meta["ema"], meta["cum"], now, None, valid)
    if policy.needs_values:  # (R, Hkv, N, D) -> (R, N); padding slots are masked by ``valid``
        v = tensors["v"].narrow(2, 0, n) if every else tensors["v"][index, :, :n]
        stats.value_norm = value_l1(v)
    scores = policy.score(stats)
    ranked = rank_rows(scores, meta["pos"], torch.tensor(keeps), now - policy.protected, policy.s, valid)
    victims = one_out(ranked)
    if victims is not None:  # one token out of every row: it takes the row's last slot
        _move(tensors, index, victims, length - 1)
        _zero_stats(tensors, index, length - 1)
        kept = [m - 1 for m in lengths]
    else:
        kept = _compact(tensors, index, kept_mask(ranked), valid)
    for seq, layer, store, before, after in zip(seqs, layers, stores, lengths, kept, strict=True):
        store.fp.n = after
        seq.count_evicted(layer, before - after)


def _compact(
    tensors: dict[str, torch.Tensor], index: torch.Tensor, mask: torch.Tensor, valid: torch.Tensor | None
) -> list[int]:
    """Keep each row's slots where ``mask`` (R, N); -> the new live counts. Row r's holes below
    its new count take, in order, its kept slots at or above it; the freed slots' statistics
    are zeroed."""
    n = mask.shape[1]
    new_n = mask.sum(1)
    cut = torch.arange(n) >= new_n.unsqueeze(1)  # (R, N) at or past the new count
    hole_r, hole_c = (~mask & ~cut).nonzero(as_tuple=True)
    _, src_c = (mask & cut).nonzero(as_tuple=True)  # row-major: pairs with the holes row by row
    if hole_c.numel():
        _move(tensors, index[hole_r], hole_c, src_c)
    free_r, free_c = (cut if valid is None else cut & valid).nonzero(as_tuple=True)
    if free_c.numel():
        _zero_stats(tensors, index[free_r], free_c)
    return new_n.tolist()


def _move(tensors: dict[str, torch.Tensor], rows: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Slot ``src[i]`` of arena row ``rows[i]`` to its slot ``dst[i]``, in every tensor: one
    ``index_select``/``index_copy_`` on a flat view each (the arena's tensors are contiguous:
    row b, head h, slot c is flat row (b*H + h)*cap + c)."""
    cap = tensors["pos"].shape[1]
    base = rows * cap
    to, frm = base + dst, base + src  # flat slots of (B, cap) metadata
    heads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for tensor in tensors.values():
        if tensor.dim() == 2:
            flat, t, f = tensor.view(-1), to, frm
        else:  # (B, Hkv, cap, D) keys and values
            h = tensor.shape[1]
            if h not in heads:
                shift = (base * (h - 1)).unsqueeze(1) + torch.arange(h) * cap
                heads[h] = ((to.unsqueeze(1) + shift).view(-1), (frm.unsqueeze(1) + shift).view(-1))
            flat, (t, f) = tensor.view(-1, tensor.shape[3]), heads[h]
        flat.index_copy_(0, t, flat.index_select(0, f))


def _zero_stats(tensors: dict[str, torch.Tensor], rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Zero the statistics of freed ``slots`` (one per entry of ``rows``), as ``_Part._shrink`` does."""
    flat = rows * tensors["pos"].shape[1] + slots
    for name in _ZEROED:
        tensors[name].view(-1).index_fill_(0, flat, 0)
