"""Recall: when to read the cold tier, which pages to bring back, and how they enter the hot set.

Triggers:
  prompt end  always (``decode.prompt_end_forward``): the last ``obs`` tokens of a prompt (the
              question; SnapKV's observation window) first run as a probe in which every layer
              scores its hot and cold tokens exactly (attention mass relative to the hot set);
              each layer's share is normalized and summed over layers (a small model's
              retrieval heads sit in a few layers, so one layer's view is noisy) and max-pooled
              over neighbouring positions; the probe is rolled back, each layer's hot set is
              re-selected by that importance (the best hot tokens and cold pages, at most
              ``rtok`` recalled tokens, fill the unprotected slots; what they displace goes
              cold), and the tail runs for real.
  (decode steps recall only when a spec asks: ``trigger=prompt`` is the default, and such a tier
  keeps no page bounds)
  gate        confkv: an unsure step (c < tau) gets the n_high budget and the room above the
              hot set is *filled* with the pages whose key bounds score best against the
              step's query (Quest-style, ``confkv_kernels.page_scores``); confident steps read
              nothing cold.
  random/every  the matched-rate controls: the same fill (gated policies) or swap (others) on
              steps drawn at ``rate`` / every ``every`` steps.
Bound score = max over query heads and queries of scaling * ub(q, page) - lse(q): an upper
bound of the log attention weight the page's best key would get relative to the hot set.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
from confkv_kernels.reference import dequantize_int8_ref

from confkv.cold import ColdStore, page_summary_bytes
from confkv.memory import KVGeometry
from confkv.policies import CachePolicy, GatedPolicy
from confkv.storage import LayerStore

POOL = 7  # prompt-end importance is max-pooled over this many neighbouring positions
SUMMARY_SHARE = 0.25  # page summaries may take at most this share of a layer's smallest budget
DROP_MARGIN = 0.125  # a full cold tier drops this share of its bound further (``ColdStore.drop_to``)


class RecallMode(enum.Enum):
    NONE = "none"
    SWAP = "swap"  # keep the hot size: recalled tokens replace the lowest-scored ones
    FILL = "fill"  # fill the free room up to the budget (gated unsure steps)
    PROBE = "probe"  # prompt end: score the cold tokens exactly, vote per page; change nothing


@dataclass
class RecallEvent:
    """One layer's recall at one step (for traces): mode, pages and tokens brought back."""

    position: int
    layer: int
    mode: str
    pages: int
    tokens: int


def _hot_keys(store: LayerStore) -> torch.Tensor:
    """(Hkv, N, D) float32: the hot keys, INT8 slots dequantized, then the FP slots."""
    k8, k8s, _, _, kf, _ = store.kv_views()
    return torch.cat([dequantize_int8_ref(k8, k8s, torch.float32), kf.float()], dim=1)


def hot_lse(store: LayerStore, q: torch.Tensor, scaling: float) -> torch.Tensor:
    """q (Hq, M, D) -> (Hq, M) float32 log-sum-exp of the logits over the hot keys."""
    keys = _hot_keys(store)  # (Hkv, N, D)
    hq, m, d = q.shape
    hkv = keys.shape[0]
    if keys.shape[1] == 0:
        return torch.full((hq, m), float("-inf"), device=q.device)
    qg = q.float().reshape(hkv, (hq // hkv) * m, d)
    return (torch.bmm(qg, keys.transpose(1, 2)) * scaling).logsumexp(-1).reshape(hq, m)


def hot_weights(store: LayerStore, q: torch.Tensor, lse: torch.Tensor, scaling: float) -> torch.Tensor:
    """(Hq, M, n) attention weight each query of q (Hq, M, D) gives each hot token (``meta``
    order), relative to the hot set (``lse`` (Hq, M))."""
    keys = _hot_keys(store)  # (Hkv, N, D)
    hq, m, d = q.shape
    hkv = keys.shape[0]
    qg = q.float().reshape(hkv, (hq // hkv) * m, d)
    logits = torch.bmm(qg, keys.transpose(1, 2)) * scaling - lse.reshape(hkv, -1, 1)
    return logits.exp().reshape(hq, m, -1)


def cold_weights(cold: ColdStore, q: torch.Tensor, lse: torch.Tensor, scaling: float) -> torch.Tensor:
    """(Hq, M, P, S) attention weight each query of q (Hq, M, D) gives each cold slot, relative
    to the hot set (``lse`` (Hq, M)); free slots hold junk (read through ``cold.valid``)."""
    hq, m, d = q.shape
    hkv = cold.k8.shape[1]
    pd = cold.payload_device
    qg = q.float().to(pd).reshape(hkv, (hq // hkv) * m, d)
    keys = cold.k8.float() * cold.ks.float().unsqueeze(-1)  # (P, Hkv, S, D)
    logits = torch.einsum("hqd,phsd->hqps", qg, keys) * scaling
    return (logits - lse.to(pd).reshape(hkv, -1, 1, 1)).exp().reshape(hq, m, *cold.valid.shape)


def cold_positions(cold: ColdStore) -> torch.Tensor:
    """(P, S) the position each cold slot stands for (page id * S + offset; junk for free slots)."""
    offsets = torch.arange(cold.page, device=cold.page_id.device)
    return cold.page_id.clamp_min(0).unsqueeze(1) * cold.page + offsets


def choose_pages(scores: torch.Tensor, counts: torch.Tensor, room: int) -> torch.Tensor:
    """Best-scored live pages, best first, while their token counts fit in ``room`` -> slots."""
    order = scores.argsort(descending=True)
    order = order[torch.isfinite(scores[order]) & (counts[order] > 0)]
    fits = counts[order].cumsum(0) <= room
    return order[fits.long().cumprod(0).bool()]


class RecallTier:
    """A sequence's cold stores (one per layer), trigger state and recall statistics."""

    def __init__(self, policy: CachePolicy, geometry: KVGeometry, device, generator: torch.Generator) -> None:
        self.policy = policy
        self.geometry = geometry
        # page bounds (hot bytes) only where a decode step scores pages by them: gated, random or
        # periodic recall; prompt-end recall reads the cold keys and needs none
        bounds = policy.recall_trigger != "prompt"
        self.cold = [ColdStore(geometry, policy.page, device, bounds) for _ in range(geometry.n_layers)]
        self.generator = generator
        self.mode = RecallMode.NONE
        self.steps = 0
        self.events: list[RecallEvent] = []
        self.recalled_tokens = 0
        self.trigger_steps = 0
        self.hot_mass: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (pos, probe mass)
        self.cold_mass: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (pos, probe mass)
        slot = geometry.int8_token_bytes if policy.int8 else geometry.fp_token_bytes
        self.slot_bytes = slot
        floor = policy.n_low if isinstance(policy, GatedPolicy) else policy.budget_rule().peak
        # the per-layer budgets of a confident step: what the prompt-end choice must fit in
        self.floors = policy.layer_budgets(floor, geometry.n_layers)
        page_bytes = page_summary_bytes(geometry)
        # summaries take hot slots, so they may never squeeze a layer below what it must hold
        # (the protected window, the sinks and the incoming token): a layer whose confident-step
        # budget has no slot to spare (a deep pyramid layer at its minimum) keeps no cold pages.
        # A tier without bounds keeps the same page limit (its host bytes are those of one with them).
        self.max_pages = [
            min(
                max(1, int(SUMMARY_SHARE * f * slot) // page_bytes),
                max(0, f - policy.min_tokens) * slot // page_bytes,
            )
            for f in self.floors
        ]
        per_layer = policy.cold_bytes // geometry.n_layers if policy.cold_bytes is not None else None
        self.max_cold_tokens = per_layer // geometry.int8_token_bytes if per_layer is not None else 1 << 62
        # the bound caps the page slots a layer allocates (pages are allocated whole), so the host
        # memory the tier holds stays within it; a bound below one page per layer keeps nothing
        # cold (it is not "no bound")
        for cold in self.cold:
            cold.max_slots = policy.cold_slots_per_layer(geometry)

    # -- sizes -------------------------------------------------------------------------------------
    def summary_tokens(self, layer: int) -> int:
        """Hot token slots the layer's page summaries stand in for (they share the budget)."""
        return math.ceil(self.cold[layer].summary_bytes() / self.slot_bytes)

    def floor_hot_budget(self, layer: int, length: int | None = None) -> int:
        """Hot token slots ``layer`` keeps on a confident step: its floor less the page
        summaries, now or (``length``) at most once any of ``length`` positions go cold."""
        if length is None:
            return self.floors[layer] - self.summary_tokens(layer)
        cold = self.cold[layer]
        pages = min(self.max_pages[layer], max(cold.n_pages, math.ceil(length / self.policy.page)))
        return self.floors[layer] - math.ceil(pages * cold.page_summary_bytes / self.slot_bytes)

    def cold_bytes(self) -> int:
        return sum(c.nbytes() for c in self.cold)

    def dropped_tokens(self) -> int:
        return sum(c.dropped_tokens for c in self.cold)

    # -- triggers ------------------------------------------------------------------------------------
    def decide(self, unsure: bool) -> bool:
        """Called once per decoding step; arms the next forward. Returns True when the step is a
        recall step (for gated policies: it gets the n_high budget)."""
        self.steps += 1
        trigger = self.policy.recall_trigger
        if trigger == "gate":
            fire = unsure
        elif trigger == "random":
            fire = bool(torch.rand((), generator=self.generator) < self.policy.rate)
        elif trigger == "every":
            fire = self.steps % self.policy.every == 0
        else:
            fire = False
        # a gated step fills the n_high - n_low room; with no room (n_low = n_high) it swaps
        pol = self.policy
        fills = isinstance(pol, GatedPolicy) and pol.n_low < pol.n_high
        self.mode = (RecallMode.FILL if fills else RecallMode.SWAP) if fire else RecallMode.NONE
        self.trigger_steps += int(fire)
        return fire

    def swap_tokens(self, layer_budget: int, step: bool = False) -> int:
        """Most tokens one recall brings back: at a prompt end ``rtok``; on a decode step
        (``step``) ``stok``, else ``rtok``'s rule. 0: half the layer budget, at least a page."""
        limit = (self.policy.stok if step else 0) or self.policy.rtok
        return limit or max(self.policy.page, layer_budget // 2)

    # -- store hooks ------------------------------------------------------------------------------------
    def add_evicted(self, layer: int, tokens: dict[str, torch.Tensor]) -> int:
        """Evicted tokens go cold; returns the tokens the bounded cold tier had to drop."""
        if not tokens:
            return 0
        cold = self.cold[layer]
        tokens, dropped = cold.make_room(tokens, self.max_pages[layer], self.max_cold_tokens)
        cold.add(tokens)
        return dropped + cold.drop_to(self.max_pages[layer], self.max_cold_tokens, DROP_MARGIN)

    def vote(self, layer: int, q: torch.Tensor, store: LayerStore, scaling: float) -> None:
        """Prompt-end probe: the exact attention weights the probe's queries q (Hq, M, D) give
        each hot and each cold token of ``layer`` (relative to the hot set), kept for
        ``importance``: with ``vote=sum`` the last ``obs`` queries' mass summed over heads and
        queries, (n,); with ``vote=last`` the last query's weights head by head, (Hq, n). Reads
        the cold keys (not values) once per prompt end."""
        last = self.policy.vote == "last"
        q_obs = q[:, -1:] if last else q[:, -self.policy.obs :]
        lse = hot_lse(store, q_obs, scaling)  # (Hq, M)
        hot = hot_weights(store, q_obs, lse, scaling)  # (Hq, M, n)
        self.hot_mass[layer] = (store.meta("pos"), hot[:, 0] if last else hot.sum(dim=(0, 1)))
        cold = self.cold[layer]
        if cold.n_tokens:
            cold.settle()
            w = cold_weights(cold, q_obs, lse, scaling)[:, :, cold.valid]  # (Hq, M, live slots)
            self.cold_mass[layer] = (cold_positions(cold)[cold.valid], w[:, 0] if last else w.sum(dim=(0, 1)))

    def importance(self, length: int, evictable: tuple[int, int] = (0, 1 << 62)) -> torch.Tensor:
        """(length,) float32 importance of every position from the probe's votes (hot and cold
        tokens), max-pooled over ``POOL`` neighbours (SnapKV: a salient token brings its
        neighbours). ``vote=sum``: each layer's share (normalized to sum 1 per layer) summed
        over layers. ``vote=last``: each layer's and query head's weights over the
        ``evictable`` positions [lo, hi) (the sinks and the protected window are kept anyway),
        normalized per head, then the largest over heads and layers: a retrieval head that
        points at a fact ranks it first even when every other head looks elsewhere (a sum over
        heads and layers buries it among the locally attended)."""
        device = next(iter(self.hot_mass.values()))[0].device if self.hot_mass else torch.device("cpu")
        g = torch.zeros(length, dtype=torch.float32, device=device)
        lo, hi = max(0, evictable[0]), min(length, evictable[1])
        for layer, (pos, mass) in self.hot_mass.items():
            parts = [(pos, mass)]
            if layer in self.cold_mass:
                cpos, cmass = self.cold_mass[layer]
                parts.append((cpos.to(device), cmass.to(device)))
            if self.policy.vote == "last":
                per_head = torch.zeros(mass.shape[0], length, dtype=torch.float32, device=device)
                for p, w in parts:  # the probe's own (rolled back) positions are left out
                    inside = p < length
                    per_head.index_add_(1, p[inside], w[:, inside].float())
                per_head[:, :lo] = 0
                per_head[:, hi:] = 0
                per_head /= per_head.sum(1, keepdim=True).clamp_min(1e-30)
                g = torch.maximum(g, per_head.amax(0))
                continue
            total = sum(float(m.sum()) for _, m in parts)
            for p, m in parts:  # the probe's own (rolled back) positions are left out
                inside = p < length
                g.index_add_(0, p[inside], m[inside].float() / max(total, 1e-12))
        if POOL > 1 and length:
            g = torch.nn.functional.max_pool1d(g.view(1, 1, -1), POOL, 1, POOL // 2).view(-1)
        return g

    def reselect(
        self,
        layer: int,
        store: LayerStore,
        g: torch.Tensor,
        protected: torch.Tensor,
        capacity: int,
        max_recall: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt-end re-selection of ``layer``'s hot set by the probe's importance ``g``.
        Hot tokens (one slot each) and cold pages (``max_recall`` tokens at most, whole pages)
        compete for ``capacity`` slots in order of importance (a page counts as its most
        important token). -> (mask over hot tokens (``meta`` order) to keep, cold slots to take)."""
        pos = store.meta("pos")
        hot_score = g[pos].masked_fill(protected, float("-inf"))
        cold = self.cold[layer]
        if cold.n_tokens:
            cold.settle()
            cpos = cold_positions(cold).clamp_max(g.shape[0] - 1)
            page_score = g.to(cold.payload_device)[cpos].masked_fill(~cold.valid, float("-inf")).amax(1)
            page_score = page_score.masked_fill(cold.page_id < 0, float("-inf")).to(g.device)
            counts = cold.page_counts()
            cand = choose_pages(page_score, counts, max_recall)
        else:
            page_score = torch.zeros(0, device=g.device)
            counts = torch.zeros(0, dtype=torch.long, device=g.device)
            cand = torch.zeros(0, dtype=torch.long, device=g.device)
        movable = (~protected).nonzero().view(-1)
        scores = torch.cat([hot_score[movable], page_score[cand]])
        costs = torch.cat([torch.ones_like(movable), counts[cand].to(movable.device)])
        order = scores.argsort(descending=True)
        chosen = order[costs[order].cumsum(0) <= capacity]
        keep = protected.clone()
        keep[movable[chosen[chosen < movable.numel()]]] = True
        slots = cand[chosen[chosen >= movable.numel()] - movable.numel()]
        return keep, slots

    def clear_probe(self) -> None:
        self.hot_mass.clear()
        self.cold_mass.clear()

    def take(self, layer: int, q: torch.Tensor, store: LayerStore, scaling: float, room: int):
        """Score layer ``layer``'s cold pages by their key bounds against the obs queries of
        q (Hq, M, D) and take the best ones that fit in ``room`` tokens -> tokens or None."""
        cold = self.cold[layer]
        if room <= 0 or cold.n_tokens == 0:
            return None
        q_obs = q[:, -self.policy.obs :]
        scores = cold.scores(q_obs, hot_lse(store, q_obs, scaling), scaling)
        return self._take(layer, store, choose_pages(scores, cold.page_counts(), room))

    def _take(self, layer: int, store: LayerStore, slots: torch.Tensor, until: int | None = None):
        """Remove pages ``slots`` from the cold tier -> their tokens, pinned until position
        ``until`` (default: ``hold`` positions from now)."""
        cold = self.cold[layer]
        device = store.fp.t["pos"].device
        if slots.numel() == 0:
            return None
        tokens = cold.take(slots)
        n = tokens["pos"].shape[0]
        until = store.next_pos + self.policy.hold if until is None else until
        tokens["pin"] = torch.full((n,), until, dtype=torch.long, device=device)
        self.recalled_tokens += n
        self.events.append(RecallEvent(store.next_pos, layer, self.mode.value, int(slots.numel()), n))
        return tokens

    def pop_events(self) -> list[RecallEvent]:
        events, self.events = self.events, []
        return events
