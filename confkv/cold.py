"""The cold tier of one sequence in one layer: evicted tokens in INT8 pages, with key bounds.

Pages are aligned to positions: page ``p`` holds positions ``p*S .. p*S+S-1`` and a token sits
at offset ``pos % S``, so a recalled page brings back a contiguous stretch of the text (a fact
and its neighbours) and inserting never searches. Layout (``confkv_kernels.recall_reference``):
  payload  k8, v8 (P, Hkv, S, D) int8, ks, vs (P, Hkv, S) f16, valid (P, S), ema, cum (P, S)
           on the hot device on CPU; in pinned host memory when the hot tier is on CUDA
  summary  lo8, hi8 (P, Hkv, D) int8, sscale (P, Hkv) f16 on the hot device (hot bytes)
Slots of freed pages are reused. Bytes: ``nbytes`` counts the live tokens' payload exactly as the
hot tier counts its INT8 slots; ``summary_bytes`` the live pages' bounds.
"""

from __future__ import annotations

import torch
from confkv_kernels import gather_pages, page_scores, scatter_pages, summarize_pages

from confkv.memory import KVGeometry


class ColdStore:
    def __init__(self, geometry: KVGeometry, page: int, device) -> None:
        self.page = page
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        self.payload_device = torch.device("cpu") if on_gpu else self.device
        self._pin = on_gpu
        h, d = geometry.n_kv_heads, geometry.head_dim
        self.token_bytes = geometry.int8_token_bytes
        self.page_summary_bytes = 2 * h * d + h * 2  # lo8 + hi8 + one f16 scale per head
        self.slot_of: dict[int, int] = {}  # page id -> slot
        self._free: list[int] = []
        self.n_tokens = 0
        self.dropped_tokens = 0
        pd, sd = self.payload_device, self.device
        self.k8 = torch.zeros(0, h, page, d, dtype=torch.int8, device=pd)
        self.v8 = torch.zeros(0, h, page, d, dtype=torch.int8, device=pd)
        self.ks = torch.zeros(0, h, page, dtype=torch.float16, device=pd)
        self.vs = torch.zeros(0, h, page, dtype=torch.float16, device=pd)
        self.valid = torch.zeros(0, page, dtype=torch.bool, device=pd)
        self.ema = torch.zeros(0, page, dtype=torch.float32, device=pd)
        self.cum = torch.zeros(0, page, dtype=torch.float32, device=pd)
        self.page_id = torch.full((0,), -1, dtype=torch.long, device=pd)
        self.lo8 = torch.zeros(0, h, d, dtype=torch.int8, device=sd)
        self.hi8 = torch.zeros(0, h, d, dtype=torch.int8, device=sd)
        self.sscale = torch.zeros(0, h, dtype=torch.float16, device=sd)
        self.live = torch.zeros(0, dtype=torch.bool, device=sd)
        # keys evicted since the bounds were last widened (slot, offset, k8, ks per token; on the
        # hot device): widening is batched, at most a page of tokens late, and always done
        # before the bounds are read or a slot is freed
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._pending_n = 0

    # -- sizes -------------------------------------------------------------------------------------
    @property
    def n_pages(self) -> int:
        return len(self.slot_of)

    def nbytes(self) -> int:
        """Exact bytes of the cold tokens (INT8 payload + scales), like an INT8 hot slot each."""
        return self.n_tokens * self.token_bytes

    def summary_bytes(self) -> int:
        return self.n_pages * self.page_summary_bytes

    # -- slots ---------------------------------------------------------------------------------------
    def _grow(self, need: int) -> None:
        cap = self.page_id.shape[0]
        if need <= cap:
            return
        new_cap = max(need, 2 * cap, 8)
        names = ("k8", "v8", "ks", "vs", "valid", "ema", "cum", "page_id", "lo8", "hi8", "sscale", "live")
        for name in names:
            old = getattr(self, name)
            fill = -1 if name == "page_id" else 0
            grown = torch.full((new_cap, *old.shape[1:]), fill, dtype=old.dtype, device=old.device)
            if self._pin and old.device.type == "cpu":
                grown = grown.pin_memory()
            grown[:cap].copy_(old)
            setattr(self, name, grown)
        self._free.extend(range(new_cap - 1, cap - 1, -1))

    def _slots_for(self, page_ids: list[int]) -> list[int]:
        missing = [p for p in page_ids if p not in self.slot_of]
        if len(missing) > len(self._free):
            self._grow(self.page_id.shape[0] + len(missing) - len(self._free))
        for p in missing:
            slot = self._free.pop()
            self.slot_of[p] = slot
            self.page_id[slot] = p
            self.live[slot] = True
        return [self.slot_of[p] for p in page_ids]

    # -- in --------------------------------------------------------------------------------------------
    def add(self, tokens: dict[str, torch.Tensor]) -> None:
        """Store evicted tokens (``LayerStore.take_int8`` layout) and widen their pages' bounds."""
        pos = tokens["pos"]
        m = pos.shape[0]
        if m == 0:
            return
        pages, local = torch.unique(pos // self.page, return_inverse=True)
        slots = torch.tensor(self._slots_for(pages.tolist()), dtype=torch.long)
        offset = pos % self.page
        pd = self.payload_device
        slot_t, off_t = slots[local.cpu()].to(pd), offset.to(pd)
        tk, tv = tokens["k"].to(pd, non_blocking=True), tokens["v"].to(pd, non_blocking=True)
        tks, tvs = tokens["ks"].to(pd, non_blocking=True), tokens["vs"].to(pd, non_blocking=True)
        scatter_pages(self.k8, self.v8, self.ks, self.vs, self.valid, slot_t, off_t, tk, tv, tks, tvs)
        self.ema[slot_t, off_t] = tokens["ema"].to(pd)
        self.cum[slot_t, off_t] = tokens["cum"].to(pd)
        self.n_tokens += m
        slot_tok = slots.to(self.device)[local.to(self.device)]
        self._pending.append((slot_tok, offset.to(self.device), tokens["k"], tokens["ks"]))
        self._pending_n += m
        if self._pending_n >= self.page:
            self.flush_bounds()

    def flush_bounds(self) -> None:
        """Widen the bounds of the pages that received keys since the last flush (one batched
        update instead of one per eviction)."""
        if not self._pending:
            return
        parts = list(zip(*self._pending, strict=True))
        slot_tok, offset = torch.cat(parts[0]), torch.cat(parts[1])
        k8, ks = torch.cat(parts[2], dim=1), torch.cat(parts[3], dim=1)  # (Hkv, n, D), (Hkv, n)
        self._pending, self._pending_n = [], 0
        slots, local = torch.unique(slot_tok, return_inverse=True)
        self._widen_bounds(slots, local, offset, k8, ks)

    def _forget_pending(self, slots: torch.Tensor) -> None:
        """Pending keys of pages leaving their slots are moot (the slot's bounds are reset)."""
        if not self._pending:
            return
        kept = []
        for slot_tok, offset, k8, ks in self._pending:
            stay = ~torch.isin(slot_tok, slots)
            if bool(stay.all()):
                kept.append((slot_tok, offset, k8, ks))
            elif bool(stay.any()):
                kept.append((slot_tok[stay], offset[stay], k8[:, stay], ks[:, stay]))
        self._pending = kept
        self._pending_n = sum(p[0].shape[0] for p in kept)

    def _widen_bounds(self, slots, local, offset, k8, ks) -> None:
        """Merge the new keys into the pages' bounds: summarize the new tokens as pages, then
        summarize {old lo, old hi, new lo, new hi} as 4-token pages (bounds are INT8 keys too)."""
        a, (h, _, d) = slots.shape[0], k8.shape
        dev = self.device
        block_k = torch.zeros(a, h, self.page, d, dtype=torch.int8, device=dev)
        block_s = torch.zeros(a, h, self.page, dtype=torch.float16, device=dev)
        block_valid = torch.zeros(a, self.page, dtype=torch.bool, device=dev)
        k8, ks, offset = k8.to(dev), ks.to(dev), offset.to(dev)
        scatter_pages(block_k, block_k, block_s, block_s, block_valid, local, offset, k8, k8, ks, ks)
        new_lo, new_hi, new_s = summarize_pages(block_k, block_s, block_valid)
        old_lo, old_hi, old_s = self.lo8[slots], self.hi8[slots], self.sscale[slots]
        had = (old_s != 0).any(-1)  # (A,) a page with bounds already (scales are never 0)
        four_k = torch.stack([old_lo, old_hi, new_lo, new_hi], dim=2)  # (A, Hkv, 4, D)
        four_s = torch.stack([old_s, old_s, new_s, new_s], dim=2)  # (A, Hkv, 4)
        four_valid = torch.stack([had, had, torch.ones_like(had), torch.ones_like(had)], dim=1)
        lo, hi, s = summarize_pages(four_k, four_s, four_valid)
        self.lo8[slots], self.hi8[slots], self.sscale[slots] = lo, hi, s

    # -- out -------------------------------------------------------------------------------------------
    def scores(self, q: torch.Tensor, lse: torch.Tensor, scaling: float) -> torch.Tensor:
        """(capacity,) upper bound of each page's best relative log-weight; -inf for free slots."""
        self.flush_bounds()
        s = page_scores(q, self.lo8, self.hi8, self.sscale, lse, scaling)
        return s.masked_fill(~self.live, float("-inf"))

    def page_counts(self) -> torch.Tensor:
        """(capacity,) cold tokens per slot, on the hot device."""
        return self.valid.sum(1).to(self.device)

    def take(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Remove pages ``slots`` (R,) and return their tokens on the hot device (INT8 layout)."""
        pd = self.payload_device
        slots_p = slots.to(pd)
        k, v, ks, vs, flat = gather_pages(self.k8, self.v8, self.ks, self.vs, self.valid, slots_p)
        slot_of_tok, off = flat // self.page, flat % self.page
        out = {
            "k": k,
            "v": v,
            "ks": ks,
            "vs": vs,
            "pos": self.page_id[slot_of_tok] * self.page + off,
            "ema": self.ema[slot_of_tok, off],
            "cum": self.cum[slot_of_tok, off],
        }
        self._free_slots(slots_p)
        return {name: t.to(self.device, non_blocking=True) for name, t in out.items()}

    def _free_slots(self, slots: torch.Tensor) -> None:
        self._forget_pending(slots.to(self.device))
        self.n_tokens -= int(self.valid[slots].sum())
        self.valid[slots] = False
        for slot, pid in zip(slots.tolist(), self.page_id[slots].tolist(), strict=True):
            del self.slot_of[pid]
            self._free.append(slot)
        self.page_id[slots] = -1
        dev_slots = slots.to(self.device)
        self.live[dev_slots] = False
        self.lo8[dev_slots] = 0
        self.hi8[dev_slots] = 0
        self.sscale[dev_slots] = 0

    def drop_to(self, max_pages: int, max_tokens: int) -> int:
        """Drop the least attended pages (max cumulative attention, older first on ties) until both
        limits hold; returns the tokens dropped (they are gone for good, and counted)."""
        if self.n_pages <= max_pages and self.n_tokens <= max_tokens:
            return 0
        live = self.page_id >= 0
        utility = self.cum.masked_fill(~self.valid, float("-inf")).amax(1)
        utility = utility + 1e-9 * self.page_id.float()
        order = utility.masked_fill(~live, float("inf")).argsort()
        counts = self.valid.sum(1)[order]
        dropped_pages = 0
        dropped = 0
        while self.n_pages - dropped_pages > max_pages or self.n_tokens - dropped > max_tokens:
            dropped += int(counts[dropped_pages])
            dropped_pages += 1
        self._free_slots(order[:dropped_pages])
        self.dropped_tokens += dropped
        return dropped
