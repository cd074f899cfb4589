"""One sequence's KV cache for one layer: an FP window of recent tokens plus an INT8 tail.

Layout (matches ``confkv_kernels``):
  fp_k, fp_v  (Hkv, cap_fp, D) model dtype   tokens within the last ``window`` positions
  q_k, q_v    (Hkv, cap_q, D)  int8          older kept tokens
  q_ks, q_vs  (Hkv, cap_q)     float16       per-(head, token) scales
Slots are unordered: eviction fills holes with the last live slots (no dead slots, O(evicted)
copies) and appends write in place, so a decode step never copies the whole cache. Per-token
metadata (positions, EMA of received attention, cumulative attention, and the position until
which a recalled token is pinned) moves with the slots. The statistics of slots past the live
ones are kept zero, so an appended token's statistics start at zero without writing them.
"""

from __future__ import annotations

import torch
from confkv_kernels import quantize_int8

_META = ("pos", "ema", "cum", "pin")
_ZEROED = ("ema", "cum", "pin")  # zero in every slot past the live ones (appends skip them)


def value_l1(v: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Values (..., Hkv, N, D) -> (..., N): each token's L1 norm averaged over KV heads (INT8
    payloads times their (..., Hkv, N) scales)."""
    norm = v.float().abs().sum(-1)
    return (norm if scale is None else norm * scale.float()).mean(-2)


class _Part:
    """Capacity-managed slots: tensors whose token axis is ``axis``; ``n`` live slots."""

    def __init__(self, tensors: dict[str, torch.Tensor], axis: dict[str, int]):
        self.t = tensors
        self.axis = axis
        self.n = 0
        self.home = None  # the ``confkv.arena.DecodeArena`` whose row ``t`` views, if any

    @property
    def capacity(self) -> int:
        return self.t["pos"].shape[0]

    def view(self, name: str) -> torch.Tensor:
        return self.t[name].narrow(self.axis[name], 0, self.n)

    def reserve(self, extra: int) -> None:
        need = self.n + extra
        if need <= self.capacity:
            return
        self.move_to(self._blank(max(need, 2 * self.capacity, 16)))

    def _blank(self, capacity: int, rows: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
        """Zeroed tensors of this part's layout with ``capacity`` slots (``rows`` leading
        dimensions first: a decode arena holds one such part per row)."""
        out = {}
        for name, old in self.t.items():
            shape = list(old.shape)
            shape[self.axis[name]] = capacity
            out[name] = old.new_zeros([*rows, *shape])
        return out

    def move_to(self, tensors: dict[str, torch.Tensor], home=None) -> None:
        """Copy the live slots into ``tensors`` (zeroed, >= n slots) and use them from now on:
        capacity growth, joining a decode arena's row (``home``), or leaving it (``own``)."""
        for name, new in tensors.items():
            ax = self.axis[name]
            new.narrow(ax, 0, self.n).copy_(self.t[name].narrow(ax, 0, self.n))
        if self.home is not None:
            self.home.broken = True
        self.t, self.home = tensors, home

    def own(self) -> None:
        """Leave a decode arena: the live slots move to tensors of this part's own."""
        if self.home is not None:
            self.move_to(self._blank(max(self.n, 16)))

    def append(self, values: dict[str, torch.Tensor]) -> None:
        m = values["pos"].shape[0]
        self.reserve(m)
        for name, value in values.items():
            self.t[name].narrow(self.axis[name], self.n, m).copy_(value)
        self.n += m

    def keep(self, mask: torch.Tensor) -> None:
        """Keep live slots where ``mask`` (n,) is True; fill holes from the end."""
        new_n = int(mask.sum())
        if new_n == self.n:
            return
        holes = (~mask[:new_n]).nonzero().squeeze(1)
        sources = mask[new_n:].nonzero().squeeze(1) + new_n
        if holes.numel():
            for name, tensor in self.t.items():
                ax = self.axis[name]
                tensor.index_copy_(ax, holes, tensor.index_select(ax, sources))
        self._shrink(new_n)

    def _shrink(self, new_n: int) -> None:
        """Live slots end at ``new_n``; the freed slots' statistics are zeroed, so they start
        from zero when they are appended to again."""
        for name in _ZEROED:
            if name in self.t:
                self.t[name].narrow(self.axis[name], new_n, self.n - new_n).zero_()
        self.n = new_n

    def split(self, mask: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """``keep(mask)`` that returns the slots it lets go (``take(~mask)``; None if none). When
        many go, one gather per tensor: the live slots are permuted kept-first, the kept prefix
        is written back (their order kept) and the rest is returned."""
        new_n = int(mask.sum())
        if new_n == self.n:
            return None
        if 8 * (self.n - new_n) < self.n:  # a few leave (a decode step): gather them, fill holes
            out = self.take(~mask)
            self.keep(mask)
            return out
        perm = torch.cat([mask.nonzero().squeeze(1), (~mask).nonzero().squeeze(1)])
        out = {}
        for name, tensor in self.t.items():
            ax = self.axis[name]
            moved = self.view(name).index_select(ax, perm)
            tensor.narrow(ax, 0, new_n).copy_(moved.narrow(ax, 0, new_n))
            out[name] = moved.narrow(ax, new_n, self.n - new_n)
        self._shrink(new_n)
        return out

    def take(self, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copies of the live slots selected by ``mask``."""
        idx = mask.nonzero().squeeze(1)
        return {name: self.view(name).index_select(self.axis[name], idx) for name in self.t}

    def nbytes(self, names) -> int:
        return sum(self.view(name).nbytes for name in names)


class LayerStore:
    """Mixed-precision KV of one sequence in one layer. Token counts in tokens, sizes in bytes."""

    def __init__(self, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device, int8: bool, window: int):
        self.int8 = int8
        self.window = window
        self.next_pos = 0  # position the next appended token gets
        self._fp_oldest = 0  # a lower bound of the FP slots' positions (skips demote_old's scan)
        h, d = n_kv_heads, head_dim

        def meta():
            return {
                "pos": torch.zeros(0, dtype=torch.long, device=device),
                "ema": torch.zeros(0, dtype=torch.float32, device=device),
                "cum": torch.zeros(0, dtype=torch.float32, device=device),
                "pin": torch.zeros(0, dtype=torch.long, device=device),
            }

        fp = {
            "k": torch.zeros(h, 0, d, dtype=dtype, device=device),
            "v": torch.zeros(h, 0, d, dtype=dtype, device=device),
        }
        q = {
            "k": torch.zeros(h, 0, d, dtype=torch.int8, device=device),
            "v": torch.zeros(h, 0, d, dtype=torch.int8, device=device),
            "ks": torch.zeros(h, 0, dtype=torch.float16, device=device),
            "vs": torch.zeros(h, 0, dtype=torch.float16, device=device),
        }
        axis = {"k": 1, "v": 1, "ks": 1, "vs": 1, "pos": 0, "ema": 0, "cum": 0, "pin": 0}
        self.fp = _Part({**fp, **meta()}, axis)
        self.q = _Part({**q, **meta()}, axis)
        self._no_int8 = (q["k"], q["ks"], q["v"], q["vs"])  # empty views for kv_views (never written)
        itemsize = torch.empty((), dtype=dtype).element_size()
        self._fp_slot_bytes = 2 * h * d * itemsize  # K + V of one token, all KV heads
        self._q_slot_bytes = 2 * h * d + 2 * h * torch.empty((), dtype=torch.float16).element_size()

    # -- sizes -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.fp.n + self.q.n

    def nbytes(self) -> int:
        """Exact bytes of the stored KV tensors: INT8 payload + scales + FP window."""
        return self.fp.nbytes(("k", "v")) + self.q.nbytes(("k", "v", "ks", "vs"))

    def nbytes_fast(self) -> int:
        """Same value as ``nbytes()`` from the live counts and per-slot sizes (no tensor views)."""
        return self.fp.n * self._fp_slot_bytes + self.q.n * self._q_slot_bytes

    def reserved_bytes(self) -> int:
        kv = [self.fp.t[n] for n in ("k", "v")] + [self.q.t[n] for n in ("k", "v", "ks", "vs")]
        return sum(t.nbytes for t in kv)

    # -- views (no copies) ---------------------------------------------------------------------
    def kv_views(self):
        """(k8, k8s, v8, v8s, kf, vf) views of the live slots, kernel layout."""
        q, fp = self.q, self.fp
        if q.n == 0:  # the common decode case without INT8 slots: two views, not six
            return (*self._no_int8, fp.view("k"), fp.view("v"))
        return q.view("k"), q.view("ks"), q.view("v"), q.view("vs"), fp.view("k"), fp.view("v")

    def meta(self, name: str) -> torch.Tensor:
        """(n,) metadata over all live tokens: INT8 slots first, then FP slots (a copy)."""
        return torch.cat([self.q.view(name), self.fp.view(name)])

    def meta_view(self, name: str) -> torch.Tensor:
        """``meta(name)`` without the copy when there are no INT8 slots: read it before the next
        mutation of this store (scoring an eviction), never keep it."""
        return self.fp.view(name) if self.q.n == 0 else self.meta(name)

    def value_norms(self) -> torch.Tensor:
        """(n,) float32 L1 norm of each live token's value vector, averaged over KV heads, in
        ``meta()`` order (INT8 slots dequantized: payload norm times scale)."""
        fp = value_l1(self.fp.view("v"))
        if self.q.n == 0:
            return fp
        return torch.cat([value_l1(self.q.view("v"), self.q.view("vs")), fp])

    # -- mutations -------------------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append a chunk k, v (Hkv, M, D) at the next positions (written in place: a decode
        step's token costs two copies and one fill, no temporary tensors; its EMA, cumulative
        attention and pin are already zero, see ``_Part.keep``)."""
        m = k.shape[1]
        part = self.fp
        part.reserve(m)
        n, t = part.n, part.t
        t["k"].narrow(1, n, m).copy_(k)
        t["v"].narrow(1, n, m).copy_(v)
        pos = t["pos"].narrow(0, n, m)
        if m == 1:
            pos.fill_(self.next_pos)
        else:
            torch.arange(self.next_pos, self.next_pos + m, out=pos)
        self.appended(m)

    def appended(self, m: int) -> None:
        """Count ``m`` tokens written past the live FP slots (k, v and positions; by ``append``,
        or for a whole decode batch at once by ``confkv.arena.DecodeArena.append``)."""
        if self.fp.n == 0:
            self._fp_oldest = self.next_pos
        self.fp.n += m
        self.next_pos += m

    def add_attention(self, mass8: torch.Tensor, massf: torch.Tensor, decay: float) -> None:
        """Fold received attention mass (N8,), (Nf,) into the EMA and the cumulative sum."""
        for part, mass in ((self.q, mass8), (self.fp, massf)):
            if part.n:
                ema = part.view("ema")
                ema.mul_(decay).add_(mass, alpha=1 - decay)
                part.view("cum").add_(mass)

    def keep(self, mask: torch.Tensor) -> None:
        """Keep tokens where ``mask`` (n,) is True, ordered as ``meta()`` (INT8 first)."""
        n_q = self.q.n
        self.q.keep(mask[:n_q])
        self.fp.keep(mask[n_q:])

    def demote_old(self, incoming: int = 0, ahead: int = 0) -> None:
        """Move FP tokens to INT8 that are (or, once ``incoming`` tokens arrive, will be) older
        than the recent window: position < next_pos + incoming - window. When some are,
        ``ahead`` more of the oldest FP tokens go too (the policy's ``slack``), so that a decode
        batch demotes about once every ``ahead`` steps instead of every step; the FP window
        only ever holds fewer tokens than ``window`` for it, never more."""
        if not self.int8 or self.fp.n == 0:
            return
        limit = self.next_pos + incoming - self.window
        if self._fp_oldest >= limit:  # a lower bound of the FP positions: nothing is old yet
            return
        cut = min(limit + max(ahead, 0), self.next_pos + incoming)
        old = self.fp.view("pos") < cut
        self._fp_oldest = cut  # every FP token left is at cut or later
        if not bool(old.any()):
            return
        moved = self.fp.take(old)
        k8, ks = quantize_int8(moved["k"])
        v8, vs = quantize_int8(moved["v"])
        self.q.append(
            {
                "k": k8,
                "v": v8,
                "ks": ks,
                "vs": vs,
                "pos": moved["pos"],
                "ema": moved["ema"],
                "cum": moved["cum"],
                "pin": moved["pin"],
            }
        )
        self.fp.keep(~old)

    # -- recall tier: tokens leave and return in INT8 form ----------------------------------------
    def evict_int8(self, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """``keep(mask)``, returning the tokens it lets go in INT8 form: k, v (Hkv, m, D) int8,
        ks, vs (Hkv, m) float16, pos, ema, cum, pin (m,); {} if none. INT8 slots leave byte for
        byte; FP slots are quantized exactly as ``demote_old`` would."""
        n_q = self.q.n
        parts = []
        if (gone := self.q.split(mask[:n_q])) is not None:
            parts.append(gone)
        if (moved := self.fp.split(mask[n_q:])) is not None:
            k8, ks = quantize_int8(moved["k"])
            v8, vs = quantize_int8(moved["v"])
            parts.append({**moved, "k": k8, "v": v8, "ks": ks, "vs": vs})
        if not parts:
            return {}
        if len(parts) == 1:
            return parts[0]
        return {name: torch.cat([p[name] for p in parts], dim=self.q.axis[name]) for name in parts[0]}

    def pin(self, mask: torch.Tensor, until: int) -> None:
        """Pin tokens where ``mask`` (n,) is True (``meta`` order) until position ``until``."""
        n_q = self.q.n
        for part, m in ((self.q, mask[:n_q]), (self.fp, mask[n_q:])):
            if bool(m.any()):
                pins = part.view("pin")
                pins[m] = torch.clamp_min(pins[m], until)

    def insert_int8(self, tokens: dict[str, torch.Tensor]) -> None:
        """Add INT8 tokens (the ``evict_int8`` layout, ``pin`` included) to the INT8 slots."""
        self.q.append(tokens)
