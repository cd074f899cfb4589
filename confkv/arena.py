"""A decode batch's FP slots in one tensor per layer and field (the CPU batched step).

Sequences that decode together step after step (continuous batching) keep their FP window in
the rows of one ``DecodeArena``: layer l's keys of all B members are one (B, Hkv, cap, D)
tensor, and row b is member b's ``_Part`` storage (a view, so every per-sequence operation:
eviction, demotion, recall, the one-sequence path, works on it unchanged). A batched step then
appends the B new tokens with one indexed write per field (``append``) and attends over
``k[:, :, :N]`` without gathering anything, folding the EMA of received attention in three
ops (``attend``). When a step begins, every member and layer that must evict does so in one
call (``make_room``, ``confkv.evict_rows``): the fields of all layers are one (L, B, ...)
tensor each, so (layer, member) pairs are rows of it. Slots past a member's live ones are
masked; their statistics stay zero because the mass a masked slot receives is exactly zero.

Membership is by identity and order. ``arena_for`` rebuilds the arena when the batch changes or
a member outgrew it (``_Part.reserve`` moved that part to tensors of its own); members that leave
the batch move back to storage of their own, so an idle session never keeps a batch's arena
alive. A batch whose members' lengths differ so much that padding would more than double the
slots gets no arena (the padded workspace path of ``confkv.batched`` serves it). Bytes reported
anywhere stay the live slots (``LayerStore.nbytes``); the arena is capacity, like ``reserve``'s.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from confkv.evict_rows import evict_rows
from confkv.policies import CachePolicy
from confkv.sequence import SequenceCache

_HEADROOM = 64  # slots past the longest member at build time (full caches grow one per step)
_NEG = float("-inf")


class DecodeArena:
    """The FP parts of ``seqs`` (every layer) moved into rows of batch tensors of ``cap`` slots."""

    def __init__(self, seqs: list[SequenceCache], cap: int):
        self.seqs = list(seqs)
        self.cap = cap
        self.broken = False  # set when a member's part leaves (growth): rebuild at the next step
        b = len(seqs)
        self.rows = torch.arange(b)
        # how the members attend (fixed while they are members): see ``_way``
        self.uniform, self.decay = _way(seqs)
        # no member evicts, demotes or recalls (``full``): a step has nothing to settle
        self.inert = all(s._inert for s in seqs)
        self.by_rows = [s.evicts_by_rows for s in seqs]  # may evict together (``make_room``)
        self.fresh = -1  # the layer whose batch append the next ``attend`` reads (-1: none)
        self._memos: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}
        n_layers = len(seqs[0].stores)
        # one tensor per field for all layers, (L, B, ...): layer l's (B, ...) is a view, and
        # ``flat`` views it as L*B rows (row l*B + b), so one ``evict_rows`` call spans layers
        every = seqs[0].stores[0].fp._blank(cap, rows=(n_layers, b))
        self.flat = {name: t.view(n_layers * b, *t.shape[2:]) for name, t in every.items()}
        self.layers = [{name: t[layer] for name, t in every.items()} for layer in range(n_layers)]
        for layer, tensors in enumerate(self.layers):
            for row, seq in enumerate(seqs):
                seq.stores[layer].fp.move_to({name: t[row] for name, t in tensors.items()}, home=self)

    def serves(self, seqs: list[SequenceCache]) -> bool:
        """The same members in the same order, none of them moved out."""
        return (
            not self.broken
            and len(seqs) == len(self.seqs)
            and all(a is b for a, b in zip(seqs, self.seqs, strict=True))
        )

    def holds(self, layer: int, room: int = 0) -> bool:
        """Every member's ``layer`` part is a row of this arena with ``room`` free slots."""
        limit = self.cap - room
        return all(p.home is self and p.n <= limit for p in (s.stores[layer].fp for s in self.seqs))

    def release(self) -> None:
        """Members whose parts are still rows of this arena move them to tensors of their own."""
        for seq in self.seqs:
            for store in seq.stores:
                if store.fp.home is self:
                    store.fp.own()

    # -- the batched step ------------------------------------------------------------------------------
    def make_room(self, layer: int, incoming: int) -> None:
        """Every member's ``before_append(layer, incoming)``. Members that evict by rows
        (``SequenceCache.evicts_by_rows``) make room in all their layers at once when the step
        begins (``layer`` 0), in one ``evict_rows`` call per policy: a layer's eviction reads
        only that layer's statistics, which the step's earlier layers do not touch, so each
        layer ends as its own ``before_append`` would leave it. The other members (and a
        policy with one row to evict) make room on their own, layer by layer."""
        together = _SWITCH.rows
        if together and layer == 0:
            self._make_room_by_rows(incoming)
        for row, seq in enumerate(self.seqs):
            if seq._inert or (together and self.by_rows[row] and seq.stores[layer].fp.home is self):
                continue  # nothing to do, or done when the step began
            seq.before_append(layer, incoming)

    def _make_room_by_rows(self, incoming: int) -> None:
        b = len(self.seqs)
        # per policy: flat rows (layer * B + member), members, layers, tokens to keep
        groups: dict[CachePolicy, tuple[list[int], list[SequenceCache], list[int], list[int]]] = {}
        for row, seq in enumerate(self.seqs):
            if not self.by_rows[row]:  # (a member that evicts by rows is never inert)
                continue
            slack = seq.policy.slack
            for layer, store in enumerate(seq.stores):
                keep = seq.eviction_target(layer, incoming, slack) if store.fp.home is self else None
                if keep is not None and len(store) > keep:
                    rows, members, layers, keeps = groups.setdefault(seq.policy, ([], [], [], []))
                    rows.append(layer * b + row)
                    members.append(seq)
                    layers.append(layer)
                    keeps.append(keep)
        for rows, members, layers, keeps in groups.values():
            if len(rows) == 1:
                members[0].evict_to(layers[0], keeps[0])
            else:
                evict_rows(self.flat, members, rows, keeps, layers)

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """key/value (B, Hkv, 1, D): member b's token goes to its next free slot (``holds(layer,
        1)`` must be true); each member counts it (``LayerStore.appended``, then its bytes), and
        ``fresh`` tells the layer's attention that every member is a row here."""
        stores = [s.stores[layer] for s in self.seqs]
        t = self.layers[layer]
        slot = self._tensor("slot", [st.fp.n for st in stores])
        t["k"][self.rows, :, slot] = key[:, :, 0]
        t["v"][self.rows, :, slot] = value[:, :, 0]
        t["pos"][self.rows, slot] = self._tensor("pos", [st.next_pos for st in stores])
        for seq, st in zip(self.seqs, stores, strict=True):
            st.appended(1)
            seq.appended(layer)
        self.fresh = layer

    def _memo(self, name: str, key: tuple[int, ...], build) -> torch.Tensor:
        """``build()``, made once for the layers of a step that share ``key`` (the members'
        slot counts or positions, alike in every layer unless some layer evicted)."""
        last = self._memos.get(name)
        if last is None or last[0] != key:
            last = self._memos[name] = (key, build())
        return last[1]

    def _tensor(self, name: str, values: list[int]) -> torch.Tensor:
        return self._memo(name, tuple(values), lambda: torch.tensor(values))

    def attend(self, layer: int, q: torch.Tensor, scaling: float, decay: float | None) -> torch.Tensor:
        """q (B, Hq, D), one query per member -> (B, Hq, D). With ``decay`` (every member ranks by
        received attention with that decay) the probabilities are formed explicitly, as the
        reference ``decode_attention_ref`` does, and folded into the EMA and cumulative sums
        (the elementwise ops of ``LayerStore.add_attention``); without, one masked SDPA."""
        b, hq, d = q.shape
        t = self.layers[layer]
        lengths = [s.stores[layer].fp.n for s in self.seqs]
        n = max(lengths)
        keys, vals = t["k"].narrow(2, 0, n), t["v"].narrow(2, 0, n)  # (B, Hkv, N, D)
        key = tuple(lengths)
        pad = None  # (B, N) True past each member's live slots
        if min(lengths) < n:
            pad = self._memo("pad", key, lambda: torch.arange(n) >= torch.tensor(lengths).unsqueeze(1))
        if decay is None:
            mask = None if pad is None else self._memo("keep", key, lambda: ~pad.view(b, 1, 1, n))
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys, vals, attn_mask=mask, scale=scaling, enable_gqa=True
            )
            return out[:, :, 0]
        hkv = keys.shape[1]
        qg = q.float().reshape(b, hkv, hq // hkv, d)  # (B, Hkv, G, D)
        logits = torch.matmul(qg, keys.float().transpose(2, 3)).mul_(scaling)  # (B, Hkv, G, N)
        if pad is not None:
            logits.masked_fill_(pad.view(b, 1, 1, n), _NEG)
        probs = torch.softmax(logits, dim=-1)
        out = torch.matmul(probs, vals.float()).view(b, hq, d).to(q.dtype)
        mass = probs.sum(dim=(1, 2))  # (B, N), exactly zero past each member's live slots
        t["ema"].narrow(1, 0, n).mul_(decay).add_(mass, alpha=1 - decay)
        t["cum"].narrow(1, 0, n).add_(mass)
        return out


_LOCAL = threading.local()


class _Switch(threading.local):
    rows = True  # members evict together (``DecodeArena.make_room``)


_SWITCH = _Switch()


@contextmanager
def evict_by_rows(enabled: bool = True) -> Iterator[None]:
    """Inside the block, on this thread, a decode batch's members evict together (``enabled``,
    the default) or each on its own (the reference a benchmark compares against; the same
    tokens either way). The previous setting comes back after."""
    before = _SWITCH.rows
    _SWITCH.rows = enabled
    try:
        yield
    finally:
        _SWITCH.rows = before


def _way(seqs: list[SequenceCache]) -> tuple[bool, float | None]:
    """How a batch attends over the arena: (uniform, decay). Uniform when no member has INT8
    slots or a recall tier and the members attend one way: all rank by received attention with
    one EMA ``decay``, or none does (decay None: one SDPA)."""
    if any(s.policy.int8 or s.tier is not None for s in seqs):
        return False, None
    ways = {s.policy.decay if s.policy.needs_attention else None for s in seqs}
    return (True, ways.pop()) if len(ways) == 1 else (False, None)


def _worth(seqs: list[SequenceCache]) -> int:
    """The capacity of an arena for ``seqs``, or 0 when one would not pay: fewer than two
    members, not on the CPU, or padding would more than double the slots."""
    if len(seqs) < 2 or seqs[0].stores[0].fp.t["k"].device.type != "cpu":
        return 0
    longest = [max(st.fp.n for st in s.stores) for s in seqs]
    cap = max(longest) + _HEADROOM
    return cap if len(seqs) * cap <= 2 * (sum(longest) + len(seqs) * _HEADROOM) else 0


def arena_for(seqs: list[SequenceCache]) -> DecodeArena | None:
    """The arena of this thread's decode batch ``seqs``: the current one while it serves them,
    else a new one (the previous one's other members move out), or None when none pays."""
    current = getattr(_LOCAL, "arena", None)
    if current is not None and current.serves(seqs):
        return current
    cap = _worth(seqs)
    arena = DecodeArena(seqs, cap) if cap else None
    if current is not None:  # the members kept are rows of the new arena already
        current.release()
    _LOCAL.arena = arena
    return arena


def release_arena() -> None:
    """Every member of this thread's arena back to storage of its own (an engine going idle)."""
    current = getattr(_LOCAL, "arena", None)
    if current is not None:
        current.release()
        _LOCAL.arena = None
