"""The cold tier of one sequence in one layer: evicted tokens in INT8 pages, with key bounds.

Pages are aligned to positions: page ``p`` holds positions ``p*S .. p*S+S-1`` and a token sits
at offset ``pos % S``, so a recalled page brings back a contiguous stretch of the text (a fact
and its neighbours) and inserting never searches. Layout (``confkv_kernels.recall_reference``):
  payload  k8, v8 (P, Hkv, S, D) int8, ks, vs (P, Hkv, S) f16, valid, shadow (P, S), ema, cum
           (P, S) on the hot device on CPU; in pinned host memory when the hot tier is on CUDA
  summary  lo8, hi8 (P, Hkv, D) int8, sscale (P, Hkv) f16 on the hot device (hot bytes); kept
           only when a decode-step trigger scores pages by them (``bounds``): a tier recalled at
           prompt ends only has none, since the probe reads the cold keys themselves
Slots of freed pages are reused. A recalled token leaves a *shadow*: its payload stays in its page
(no longer ``valid``: never scored, voted or recalled again while it is hot), so when it is evicted
again (a gated step's room is emptied on the next confident step) it only turns valid again: no
copy, no bound widening, no new page. Hot INT8 tokens never change, so the shadow is the token.
Bytes: ``nbytes`` counts the stored payload (valid and shadow tokens) exactly as the hot tier
counts its INT8 slots; ``summary_bytes`` the bounds of the pages that hold cold tokens (a page
of shadows only keeps its bounds in its slot, unread and uncounted, like a free slot's rows,
until one of its tokens is evicted again).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import torch
from confkv_kernels import gather_pages, page_scores, scatter_pages
from confkv_kernels.recall_reference import quantize_bounds_ref

from confkv.memory import KVGeometry


def page_summary_bytes(geometry: KVGeometry) -> int:
    """Bytes of one page's key bounds: lo8 + hi8 (Hkv, D) int8 and one f16 scale per KV head."""
    return 2 * geometry.n_kv_heads * geometry.head_dim + geometry.n_kv_heads * 2


class ColdStore:
    def __init__(self, geometry: KVGeometry, page: int, device, bounds: bool = True) -> None:
        self.page = page
        # key bounds are kept (and count as hot bytes) only when a decode-step trigger scores
        # pages by them; prompt-end recall reads the cold keys themselves
        self.bounds = bounds
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        self.payload_device = torch.device("cpu") if on_gpu else self.device
        self._pin = on_gpu
        h, d = geometry.n_kv_heads, geometry.head_dim
        self.token_bytes = geometry.int8_token_bytes
        self.page_summary_bytes = page_summary_bytes(geometry) if bounds else 0
        self.slot_of: dict[int, int] = {}  # page id -> slot (pages with cold or shadow tokens)
        self.counts: list[int] = []  # cold (valid or queued) tokens per slot
        self.n_pages = 0  # pages holding cold tokens: the live summaries
        self._free: list[int] = []
        self._pages_seen = 0  # 1 + the largest page id given a slot: the pages that can exist so far
        self.max_slots: int | None = None  # page slots it may allocate (``cold_bytes``); None: no bound
        self.n_tokens = 0  # valid (cold-only) tokens
        self.n_shadow = 0  # payload kept for recalled tokens that are hot now
        self.dropped_tokens = 0
        pd, sd = self.payload_device, self.device
        self.k8 = torch.zeros(0, h, page, d, dtype=torch.int8, device=pd)
        self.v8 = torch.zeros(0, h, page, d, dtype=torch.int8, device=pd)
        self.ks = torch.zeros(0, h, page, dtype=torch.float16, device=pd)
        self.vs = torch.zeros(0, h, page, dtype=torch.float16, device=pd)
        self.valid = torch.zeros(0, page, dtype=torch.bool, device=pd)
        self.shadow = torch.zeros(0, page, dtype=torch.bool, device=pd)
        self.ema = torch.zeros(0, page, dtype=torch.float32, device=pd)
        self.cum = torch.zeros(0, page, dtype=torch.float32, device=pd)
        self.page_id = torch.full((0,), -1, dtype=torch.long, device=pd)
        self.lo8 = torch.zeros(0, h, d if bounds else 0, dtype=torch.int8, device=sd)
        self.hi8 = torch.zeros(0, h, d if bounds else 0, dtype=torch.int8, device=sd)
        self.sscale = torch.zeros(0, h if bounds else 0, dtype=torch.float16, device=sd)
        self.live = torch.zeros(0, dtype=torch.bool, device=sd)
        # keys evicted since the bounds were last widened (slot, k8, ks per token; on the
        # hot device): widening is batched, at most a page of tokens late, and always done
        # before the bounds are read or a slot is freed
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._pending_n = 0
        # evicted tokens not yet written to their pages (``add``; counted, pages allocated)
        self._inbox: list[tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]] = []
        self._inbox_n = 0

    # -- sizes -------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Exact bytes of the stored payload (INT8 + scales; valid and shadow tokens), like an INT8
        hot slot each."""
        return (self.n_tokens + self.n_shadow) * self.token_bytes

    def reserved_bytes(self) -> int:
        """Bytes of the payload tensors as allocated (INT8 + scales of every page slot, free ones
        included): what the tier holds in (host) memory. At most one slot per page of positions
        seen (``_grow``), so at most the pages of the context, whole."""
        return self.page_id.shape[0] * self.page * self.token_bytes

    def summary_bytes(self) -> int:
        return self.n_pages * self.page_summary_bytes

    # -- slots ---------------------------------------------------------------------------------------
    def _grow(self, need: int, pages_seen: int) -> None:
        """At least ``need`` slots: doubling for amortized growth, but never more slots than the
        ``pages_seen`` pages of positions that can exist so far (pages are position-aligned, so
        a slot past them could never be used)."""
        cap = self.page_id.shape[0]
        if need <= cap:
            return
        new_cap = max(need, min(max(2 * cap, 8), pages_seen, self.max_slots or need))
        names = "k8 v8 ks vs valid shadow ema cum page_id lo8 hi8 sscale live".split()
        for name in names:
            old = getattr(self, name)
            fill = -1 if name == "page_id" else 0
            grown = torch.full((new_cap, *old.shape[1:]), fill, dtype=old.dtype, device=old.device)
            if self._pin and old.device.type == "cpu":
                grown = grown.pin_memory()
            grown[:cap].copy_(old)
            setattr(self, name, grown)
        self._free.extend(range(new_cap - 1, cap - 1, -1))
        self.counts.extend([0] * (new_cap - cap))

    def _slots_for(self, page_ids: list[int]) -> list[int]:
        missing = [p for p in page_ids if p not in self.slot_of]
        if len(missing) > len(self._free):
            self._pages_seen = max(self._pages_seen, max(missing) + 1)
            self._grow(self.page_id.shape[0] + len(missing) - len(self._free), self._pages_seen)
        for p in missing:
            slot = self._free.pop()
            self.slot_of[p] = slot
            self.page_id[slot] = p
            self.live[slot] = True
        return [self.slot_of[p] for p in page_ids]

    # -- in --------------------------------------------------------------------------------------------
    def add(self, tokens: dict[str, torch.Tensor]) -> None:
        """Store evicted tokens (``LayerStore.evict_int8`` layout). Counts and pages are exact at
        once; the payload is written and the bounds widened in batches (``settle``: when a page
        of tokens has arrived, and before anything reads the pages)."""
        pos = tokens["pos"]
        m = pos.shape[0]
        if m == 0:
            return
        pd = self.payload_device
        if m <= 8:  # a decode step's eviction: plain Python beats the tensor ops' overhead
            pos_list = pos.tolist()
            self._slots_for(sorted({p // self.page for p in pos_list}))
            slot_t = torch.tensor(
                [self.slot_of[p // self.page] for p in pos_list], dtype=torch.long, device=pd
            )
            off_t = torch.tensor([p % self.page for p in pos_list], dtype=torch.long, device=pd)
        else:
            pages, local = torch.unique(pos // self.page, return_inverse=True)
            slots = torch.tensor(self._slots_for(pages.tolist()), dtype=torch.long)
            slot_t, off_t = slots[local.cpu()].to(pd), (pos % self.page).to(pd)
        n_back = int(self.shadow[slot_t, off_t].sum()) if self.n_shadow else 0
        self._count(Counter(slot_t.tolist()))
        self.n_tokens += m
        self.n_shadow -= n_back
        self._inbox.append((tokens, slot_t, off_t))
        self._inbox_n += m
        if self._inbox_n >= self.page:
            self.settle()

    def _count(self, per_slot: Mapping[int, int]) -> None:
        """Add ``per_slot`` cold tokens to slots' counts (negative: remove), keeping ``n_pages``."""
        counts = self.counts
        for slot, d in per_slot.items():
            before = counts[slot]
            counts[slot] = before + d
            self.n_pages += (counts[slot] > 0) - (before > 0)

    def settle(self) -> None:
        """Write the tokens ``add`` has queued into their pages (payload, ``valid``, scores;
        called before anything reads the pages). Tokens with a shadow (recalled, now evicted
        again) only turn valid again: their payload is still here and their keys are inside the
        page bounds. The others' keys wait in ``_pending`` to widen the bounds (at most a page
        of tokens late, always before the bounds are read)."""
        if not self._inbox:
            return
        inbox, self._inbox, self._inbox_n = self._inbox, [], 0
        if len(inbox) == 1:
            tokens, slot_t, off_t = inbox[0]
        else:
            parts = [t for t, _, _ in inbox]
            tokens = {
                name: torch.cat([t[name] for t in parts], dim=min(1, parts[0][name].dim() - 1))
                for name in parts[0]
            }
            slot_t, off_t = torch.cat([s for _, s, _ in inbox]), torch.cat([o for _, _, o in inbox])
        self._write(tokens, slot_t, off_t)
        if self._pending_n >= self.page:
            self.flush_bounds()

    def _write(self, tokens: dict[str, torch.Tensor], slot_t: torch.Tensor, off_t: torch.Tensor) -> None:
        pd = self.payload_device
        self.ema[slot_t, off_t] = tokens["ema"].to(pd)
        self.cum[slot_t, off_t] = tokens["cum"].to(pd)
        back = self.shadow[slot_t, off_t]
        if bool(back.any()):
            self.shadow[slot_t[back], off_t[back]] = False
            self.valid[slot_t[back], off_t[back]] = True
            if bool(back.all()):
                return
            new = ~back
            slot_t, off_t = slot_t[new], off_t[new]
            tokens = {name: tokens[name][:, new.to(tokens[name].device)] for name in ("k", "v", "ks", "vs")}
        tk, tv = tokens["k"].to(pd, non_blocking=True), tokens["v"].to(pd, non_blocking=True)
        tks, tvs = tokens["ks"].to(pd, non_blocking=True), tokens["vs"].to(pd, non_blocking=True)
        scatter_pages(self.k8, self.v8, self.ks, self.vs, self.valid, slot_t, off_t, tk, tv, tks, tvs)
        if not self.bounds:
            return
        self._pending.append((slot_t.to(self.device), tokens["k"], tokens["ks"]))
        self._pending_n += slot_t.shape[0]

    def flush_bounds(self) -> None:
        """Widen the bounds of the pages that received keys since the last flush (one batched
        update instead of one per eviction)."""
        if not self._pending:
            return
        parts = list(zip(*self._pending, strict=True))
        slot_tok = torch.cat(parts[0])
        k8, ks = torch.cat(parts[1], dim=1), torch.cat(parts[2], dim=1)  # (Hkv, n, D), (Hkv, n)
        self._pending, self._pending_n = [], 0
        slots, local = torch.unique(slot_tok, return_inverse=True)
        self._widen_bounds(slots, local, k8, ks)

    def _forget_pending(self, slots: torch.Tensor) -> None:
        """Pending keys of pages leaving their slots are moot (the slot's bounds are reset)."""
        if not self._pending:
            return
        kept = []
        for slot_tok, k8, ks in self._pending:
            stay = ~torch.isin(slot_tok, slots)
            if bool(stay.all()):
                kept.append((slot_tok, k8, ks))
            elif bool(stay.any()):
                kept.append((slot_tok[stay], k8[:, stay], ks[:, stay]))
        self._pending = kept
        self._pending_n = sum(p[0].shape[0] for p in kept)

    def _widen_bounds(self, slots, local, k8, ks) -> None:
        """Merge the new keys k8, ks (Hkv, n, D), (Hkv, n) of pages ``slots[local]`` into the
        pages' bounds: the new keys' exact per-dimension min/max, rounded outward to INT8 as a
        page of their own would be (``quantize_bounds_ref``), then merged with the old bounds and
        rounded outward again, so every key stays inside. (Rounding the new keys' bounds on
        their own first, as ``summarize_pages`` of the new keys would, measured better dev
        perplexity than one rounding of the exact merge: 25.08 vs 25.13 on Emma.)"""
        a, (h, _, d) = slots.shape[0], k8.shape
        dev = self.device
        keys = k8.to(dev).float() * ks.to(dev).float().unsqueeze(-1)  # exact: int8 x f16 fits f32
        idx = local.to(dev).view(1, -1, 1).expand_as(keys)
        lo = torch.full((h, a, d), float("inf"), device=dev).scatter_reduce_(1, idx, keys, "amin")
        hi = torch.full((h, a, d), float("-inf"), device=dev).scatter_reduce_(1, idx, keys, "amax")
        new_lo8, new_hi8, new_s = quantize_bounds_ref(lo.transpose(0, 1), hi.transpose(0, 1))
        s = new_s.float().unsqueeze(-1)
        lo, hi = new_lo8.float() * s, new_hi8.float() * s  # (A, Hkv, D)
        old_s = self.sscale[slots]
        had = (old_s != 0).any(-1).view(-1, 1, 1)  # a page with bounds already (scales are never 0)
        s = old_s.float().unsqueeze(-1)
        lo = torch.where(had, torch.minimum(lo, self.lo8[slots].float() * s), lo)
        hi = torch.where(had, torch.maximum(hi, self.hi8[slots].float() * s), hi)
        self.lo8[slots], self.hi8[slots], self.sscale[slots] = quantize_bounds_ref(lo, hi)

    # -- out -------------------------------------------------------------------------------------------
    def scores(self, q: torch.Tensor, lse: torch.Tensor, scaling: float) -> torch.Tensor:
        """(capacity,) upper bound of each page's best relative log-weight; -inf for free slots."""
        if not self.bounds:
            raise RuntimeError("this cold tier keeps no key bounds (prompt-end recall only)")
        self.settle()
        self.flush_bounds()
        s = page_scores(q, self.lo8, self.hi8, self.sscale, lse, scaling)
        return s.masked_fill(~self.live, float("-inf"))

    def page_counts(self) -> torch.Tensor:
        """(capacity,) cold tokens per slot, on the hot device."""
        self.settle()
        return self.valid.sum(1).to(self.device)

    def take(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Recall the valid tokens of pages ``slots`` (R,) -> their tokens on the hot device (INT8
        layout). Their payload stays as shadows (the pages keep their slots and bounds)."""
        self.settle()
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
        n = off.shape[0]
        self._count({slot: -self.counts[slot] for slot in slots_p.tolist()})
        self.shadow[slots_p] |= self.valid[slots_p]
        self.valid[slots_p] = False
        self.n_tokens -= n
        self.n_shadow += n
        return {name: t.to(self.device, non_blocking=True) for name, t in out.items()}

    def forget_from(self, start: int) -> None:
        """Forget every token (valid or shadow) at positions >= ``start``: a rolled-back probe's
        positions are fed again, and their new keys must not meet stale copies."""
        first = start // self.page
        late = [p for p in self.slot_of if p >= first]
        if not late:
            return
        self.settle()
        offsets = torch.arange(self.page, device=self.payload_device)
        for p in late:
            slot = self.slot_of[p]
            gone = (p * self.page + offsets) >= start
            lost = int((self.valid[slot] & gone).sum())
            self.n_tokens -= lost
            self._count({slot: -lost})
            self.n_shadow -= int((self.shadow[slot] & gone).sum())
            self.valid[slot] &= ~gone
            self.shadow[slot] &= ~gone
            if not bool(self.valid[slot].any() | self.shadow[slot].any()):
                self._free_slots(torch.tensor([slot], dtype=torch.long, device=self.payload_device))

    def _free_slots(self, slots: torch.Tensor) -> None:
        self.settle()
        self._forget_pending(slots.to(self.device))
        self.n_tokens -= int(self.valid[slots].sum())
        self.n_shadow -= int(self.shadow[slots].sum())
        self.valid[slots] = False
        self.shadow[slots] = False
        self._count({slot: -self.counts[slot] for slot in slots.tolist()})
        for slot, pid in zip(slots.tolist(), self.page_id[slots].tolist(), strict=True):
            del self.slot_of[pid]
            self._free.append(slot)
        self.page_id[slots] = -1
        dev_slots = slots.to(self.device)
        self.live[dev_slots] = False
        self.lo8[dev_slots] = 0
        self.hi8[dev_slots] = 0
        self.sscale[dev_slots] = 0

    def make_room(
        self, tokens: dict[str, torch.Tensor], max_pages: int, max_tokens: int
    ) -> tuple[dict[str, torch.Tensor], int]:
        """Before ``add``: with a slot bound (``max_slots``), drop stored pages (as ``drop_to``)
        until the pages the evicted ``tokens`` need fit in it, so the tier never allocates past
        the bound. When their new pages alone pass it, only the tokens of the newest pages that
        fit are kept. -> (the tokens to add, tokens dropped)."""
        if self.max_slots is None:
            return tokens, 0
        page_ids = (tokens["pos"] // self.page).tolist()
        need = set(page_ids)
        missing = need - self.slot_of.keys()
        if len(self.slot_of) + len(missing) <= self.max_slots:
            return tokens, 0
        dropped = self.drop_to(max_pages, max_tokens, max_slots=max(self.max_slots - len(missing), 0))
        missing = need - self.slot_of.keys()
        room = self.max_slots - len(self.slot_of)
        if len(missing) <= room:
            return tokens, dropped
        allowed = (need & self.slot_of.keys()) | set(
            sorted(missing)[len(missing) - room :] if room > 0 else []
        )
        keep = torch.tensor([p in allowed for p in page_ids], dtype=torch.bool, device=tokens["pos"].device)
        lost = int((~keep).sum())
        self.dropped_tokens += lost
        kept = {name: t[..., keep] if t.dim() == 1 else t[:, keep] for name, t in tokens.items()}
        return kept, dropped + lost

    def drop_to(
        self, max_pages: int, max_tokens: int, margin: float = 0.0, max_slots: int | None = None
    ) -> int:
        """Drop pages until both limits hold (``max_pages`` live summaries; ``max_tokens`` stored
        tokens, shadows included): pages holding only shadows first (nothing is lost: their
        tokens are hot), then the least attended (max cumulative attention, older first on
        ties). Once a limit is exceeded, ``margin`` (a fraction) drops that much further below
        it (a low watermark: a full tier then drops a batch of pages every few evictions instead
        of one page on nearly every eviction). Returns the cold tokens dropped (they are gone for
        good, and counted)."""
        slots = self.max_slots if max_slots is None else max_slots
        if slots is None:
            slots = 1 << 62
        if (
            self.n_pages <= max_pages
            and self.n_tokens + self.n_shadow <= max_tokens
            and len(self.slot_of) <= slots
        ):
            return 0
        self.settle()
        max_pages, max_tokens, slots = (
            limit - int(margin * limit) for limit in (max_pages, max_tokens, slots)
        )
        live = self.page_id >= 0
        utility = self.cum.masked_fill(~self.valid, float("-inf")).amax(1)
        utility = utility.clamp_min(-1e30) + 1e-9 * self.page_id.float()
        order = utility.masked_fill(~live, float("inf")).argsort()[: int(live.sum())]
        counts = self.valid.sum(1)[order]
        stored = counts + self.shadow.sum(1)[order]
        # after dropping the first i pages of ``order`` (i = 0..len): live summaries, tokens left;
        # the last entry (every page dropped) always holds, so the first that holds exists
        zero = torch.zeros(1, dtype=torch.long, device=counts.device)
        pages_left = self.n_pages - torch.cat([zero, (counts > 0).long().cumsum(0)])
        tokens_left = self.n_tokens + self.n_shadow - torch.cat([zero, stored.cumsum(0)])
        slots_left = len(self.slot_of) - torch.arange(order.shape[0] + 1, device=counts.device)
        holds = (pages_left <= max_pages) & (tokens_left <= max_tokens) & (slots_left <= slots)
        n_drop = int(holds.long().argmax())
        dropped = int(counts[:n_drop].sum())
        self._free_slots(order[:n_drop])
        self.dropped_tokens += dropped
        return dropped
