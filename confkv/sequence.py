"""One sequence's Conf-KV state: its policy, per-layer stores, budget and byte statistics."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

from confkv.confidence import ConfidenceWeights
from confkv.memory import KVGeometry
from confkv.policies import CachePolicy, GatedPolicy, TokenStats, select_keep
from confkv.recall import RecallEvent, RecallMode, RecallTier
from confkv.storage import LayerStore


def seed_of(name: str) -> int:
    """A sequence seed of its own for a named sequence (an eval item, a worker session), stable
    across runs and order: a ``trigger=random`` control then draws its steps independently per
    sequence (with one seed for all, every sequence fired on the same steps, and on short
    answers the realized rate was that seed's first few draws, not ``rate``). Policies with a
    ``seed`` key (``random``) keep theirs."""
    return zlib.crc32(name.encode())


_PIN_BONUS = 1e9  # pinned (just recalled) tokens outrank every unpinned one; the budget stays hard


@dataclass
class StepRecord:
    """What happened at one decoding step (for traces)."""

    confidence: float | None
    budget: int
    tokens_per_layer: list[int]
    bytes_per_layer: list[int]
    cold_bytes: int = 0
    recalls: list[RecallEvent] = field(default_factory=list)


@dataclass
class SequenceStats:
    peak_bytes: int = 0
    evicted_tokens: int = 0
    evictions_per_step: list[int] = field(default_factory=list)
    peak_cold_bytes: int = 0
    recalled_tokens: int = 0
    cold_dropped_tokens: int = 0
    recall_steps: int = 0


class SequenceCache:
    """Conf-KV cache of a single sequence across all layers. Bytes are exact stored bytes."""

    def __init__(self, policy: CachePolicy, geometry: KVGeometry, dtype: torch.dtype, device, seed: int = 0):
        self.policy = policy.resolve(geometry)
        self.geometry = geometry
        self.rule = self.policy.budget_rule()
        self.stores = [
            LayerStore(geometry.n_kv_heads, geometry.head_dim, dtype, device, self.policy.int8, self.policy.w)
            for _ in range(geometry.n_layers)
        ]
        self.generator = torch.Generator().manual_seed(int(getattr(self.policy, "seed", seed)))
        self.tier = RecallTier(self.policy, geometry, device, self.generator) if self.policy.recall else None
        # never evicts, demotes or recalls (``full``): make-room and settle have nothing to do
        self._inert = not self.policy.evicts and not self.policy.int8 and self.tier is None
        self.layer_bytes = [0] * geometry.n_layers
        self._total_bytes = 0
        self._cold_layer_bytes = [0] * geometry.n_layers  # cold bytes as of each layer's refresh
        self._cold_bytes = 0
        self.stats = SequenceStats()
        self.last_confidence: float | None = None
        self._evicted_this_step = 0
        self.set_budget(self.rule(None))
        weights = getattr(self.policy, "confidence_weights", None)
        self.confidence_weights = weights() if weights else ConfidenceWeights()

    # -- budget ----------------------------------------------------------------------------------
    def set_budget(self, total: int) -> None:
        """Token budget per layer for the coming step(s); pyramid policies split it by depth."""
        self.budget = int(total)
        if self.policy.evicts:
            self.layer_budgets = self.policy.layer_budgets(self.budget, self.geometry.n_layers)
        else:
            self.layer_budgets = [self.budget] * self.geometry.n_layers

    def observe_confidence(self, confidence: float) -> int:
        """Feed the confidence of the newest logits; returns the budget chosen for the next step."""
        self.last_confidence = float(confidence)
        self.stats.evictions_per_step.append(self._evicted_this_step)
        self._evicted_this_step = 0
        budget = self.rule(self.last_confidence)
        if self.tier is not None:
            pol = self.policy
            fire = self.tier.decide(unsure=isinstance(pol, GatedPolicy) and self.last_confidence < pol.tau)
            self.stats.recall_steps += int(fire)
            if isinstance(pol, GatedPolicy) and pol.recall_trigger in ("random", "every"):
                budget = pol.n_high if fire else pol.n_low
        self.set_budget(budget)
        return self.budget

    @property
    def follows_confidence(self) -> bool:
        """Whether the budget or the recall trigger reads the confidence (``observe_confidence``):
        gated policies and recall tiers; a fixed budget without a tier does not."""
        return isinstance(self.policy, GatedPolicy) or self.tier is not None

    # -- sizes -------------------------------------------------------------------------------------
    @property
    def seen_tokens(self) -> int:
        return self.stores[0].next_pos

    def nbytes(self) -> int:
        """Hot bytes: stored KV tensors the attention reads, plus the cold pages' summaries."""
        return self._total_bytes

    def cold_nbytes(self) -> int:
        return self.tier.cold_bytes() if self.tier is not None else 0

    def cold_reserved_bytes(self) -> int:
        """Host bytes the cold tier's payload tensors hold as allocated (whole pages, free slots
        included); ``cold_nbytes`` counts only the tokens stored in them."""
        return sum(c.reserved_bytes() for c in self.tier.cold) if self.tier is not None else 0

    def hot_budget(self, layer: int) -> int:
        """Token slots of ``layer`` for this step: its budget less what page summaries take."""
        if self.tier is None:
            return self.layer_budgets[layer]
        return self.layer_budgets[layer] - self.tier.summary_tokens(layer)

    def tokens_per_layer(self) -> list[int]:
        return [len(s) for s in self.stores]

    def record(self) -> StepRecord:
        recalls = self.tier.pop_events() if self.tier is not None else []
        return StepRecord(
            self.last_confidence,
            self.budget,
            self.tokens_per_layer(),
            list(self.layer_bytes),
            self.cold_nbytes(),
            recalls,
        )

    def _refresh_bytes(self, layer: int) -> None:
        now = self.stores[layer].nbytes_fast()
        if self.tier is not None:
            cold = self.tier.cold[layer]
            now += cold.summary_bytes()
            cold_now = cold.nbytes()
            self._cold_bytes += cold_now - self._cold_layer_bytes[layer]
            self._cold_layer_bytes[layer] = cold_now
            self.stats.peak_cold_bytes = max(self.stats.peak_cold_bytes, self._cold_bytes)
        self._total_bytes += now - self.layer_bytes[layer]
        self.layer_bytes[layer] = now
        if self._total_bytes > self.stats.peak_bytes:
            self.stats.peak_bytes = self._total_bytes

    # -- eviction -----------------------------------------------------------------------------------
    def evict_to(self, layer: int, keep: int) -> int:
        """Evict lowest-scored tokens of ``layer`` down to ``keep`` (never protected ones)."""
        store = self.stores[layer]
        n = len(store)
        keep = max(keep, 0)
        if not self.policy.evicts or n <= keep:
            return 0
        meta = store.meta_view  # read-only until ``keep`` below
        positions = meta("pos")
        stats = TokenStats(positions, meta("ema"), meta("cum"), store.next_pos, self.generator)
        if self.policy.needs_values:
            stats.value_norm = store.value_norms()
        scores = self.policy.score(stats)
        if self.tier is not None:
            scores = scores.float() + _PIN_BONUS * (meta("pin") >= store.next_pos)
        mask = select_keep(scores, positions, keep, store.next_pos - self.policy.protected, self.policy.s)
        if self.tier is not None:
            dropped = self.tier.add_evicted(layer, store.evict_int8(mask))
            self.stats.cold_dropped_tokens += dropped
        else:
            store.keep(mask)
        evicted = n - len(store)
        self.count_evicted(layer, evicted)
        return evicted

    def count_evicted(self, layer: int, evicted: int) -> None:
        """Count ``evicted`` tokens that left ``layer`` (here, or for a whole decode batch at
        once by ``confkv.evict_rows``), then its bytes."""
        self.stats.evicted_tokens += evicted
        self._evicted_this_step += evicted
        self._refresh_bytes(layer)

    @property
    def evicts_by_rows(self) -> bool:
        """Whether a decode batch may evict this sequence's layers together with others'
        (``confkv.evict_rows``): FP only, no recall tier, a policy that scores rows."""
        return self.policy.evicts and self.policy.scores_rows and not self.policy.int8 and self.tier is None

    def eviction_target(self, layer: int, incoming: int = 0, slack: int = 0) -> int | None:
        """The tokens ``_fit`` first evicts ``layer`` down to (>= 0), or None when the layer
        holds at most its hot budget once ``incoming`` tokens arrive."""
        budget = self.hot_budget(layer)
        if len(self.stores[layer]) + incoming <= budget:
            return None
        return max(budget - incoming - slack, 0)

    def before_append(self, layer: int, incoming: int) -> None:
        """Make room so that the layer holds at most its budget, and at most ``w`` FP tokens
        (INT8 policies), after ``incoming`` tokens arrive: peak bytes stay within the bound."""
        if self._inert:
            return
        self._fit(layer, incoming, self.policy.slack)
        self.stores[layer].demote_old(incoming, self.policy.slack)

    def _fit(self, layer: int, incoming: int = 0, slack: int = 0) -> None:
        """Evict until ``layer`` holds at most its hot budget once ``incoming`` tokens arrive.
        With recall, evicted tokens may open cold pages whose summaries take hot slots, so the
        budget can shrink while evicting: repeat until it holds (converges in a few rounds)."""
        store = self.stores[layer]
        if (keep := self.eviction_target(layer, incoming, slack)) is not None:
            self.evict_to(layer, keep)
        while self.tier is not None and len(store) + incoming > self.hot_budget(layer):
            if self.evict_to(layer, self.hot_budget(layer) - incoming) == 0:
                break

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.stores[layer].append(k, v)
        self._refresh_bytes(layer)

    def appended(self, layer: int) -> None:
        """Count what a batch append (``confkv.arena.DecodeArena.append``) wrote to ``layer``."""
        self._refresh_bytes(layer)

    def after_attention(self, layer: int, mass8: torch.Tensor, massf: torch.Tensor) -> None:
        """EMA update, then evict what a prompt chunk larger than the free room overflowed."""
        if self.policy.needs_attention:
            self.stores[layer].add_attention(mass8, massf, self.policy.decay)
        self.settle(layer)

    def settle(self, layer: int) -> None:
        """The part of ``after_attention`` after the EMA update (a batch folds its sequences'
        EMAs in one call, ``confkv.batched.fold_attention``, then settles each sequence)."""
        if self._inert:
            return
        store = self.stores[layer]
        self._fit(layer)
        # before_append already demoted everything the window lets go of; FP tokens can only be
        # out of the window here when a chunk longer than the window arrived in one piece.
        if store.int8 and store.fp.n > store.window:
            store.demote_old()
            self._refresh_bytes(layer)

    # -- recall ------------------------------------------------------------------------------------------
    def maybe_recall(self, layer: int, q: torch.Tensor, scaling: float) -> int:
        """Before ``layer`` attends with q (Hq, M, D): if this forward is armed, bring back the
        cold pages the queries point at (fill the free room, or swap up to ``stok`` tokens with
        the lowest-scored hot ones), or only vote (prompt-end probe). Returns tokens recalled."""
        tier = self.tier
        if tier is None or tier.mode is RecallMode.NONE:
            return 0
        store = self.stores[layer]
        if tier.mode is RecallMode.PROBE:
            tier.vote(layer, q, store, scaling)
            return 0
        room = self._recall_room(layer)
        return self._bring_back(layer, tier.take(layer, q, store, scaling, room))

    def _recall_room(self, layer: int) -> int:
        budget = self.hot_budget(layer)
        free = max(0, budget - len(self.stores[layer]))
        if self.tier is None or self.tier.mode is RecallMode.FILL:
            return free
        movable = budget - self.policy.protected - self.policy.s - 1
        return max(free, min(self.tier.swap_tokens(budget, step=True), movable))

    def _bring_back(self, layer: int, tokens: dict[str, torch.Tensor] | None) -> int:
        """Insert recalled tokens, first evicting (to cold) what they displace: the hot set
        never exceeds ``hot_budget``."""
        if not tokens:
            return 0
        n = tokens["pos"].shape[0]
        self._fit(layer, incoming=n)
        self.stores[layer].insert_int8(tokens)
        self.stats.recalled_tokens += n
        self._refresh_bytes(layer)
        return n

    def demote_to_cold(self) -> int:
        """Idle demotion (a serving worker's answer to hot-memory pressure between turns): move
        every hot token except the protected ones (sinks and the recent window) to the cold tier,
        where the next turn's prompt-end probe can recall them. Returns the tokens moved; 0 when
        there is no cold tier or nothing left to move. Positions, scores and bytes stay exact."""
        if self.tier is None:
            return 0
        moved = 0
        for layer in range(self.geometry.n_layers):
            moved += self.evict_to(layer, self.policy.s + self.policy.protected)
        return moved

    # -- prompt end: probe, roll back, re-select hot sets by the probe ------------------------------------
    def arm(self, mode: RecallMode) -> None:
        if self.tier is not None:
            self.tier.mode = mode

    def needs_probe(self, incoming: int) -> bool:
        """A prompt-end probe is worth running: tokens are cold, or some layer will have to
        evict once ``incoming`` more arrive (the probe then decides what stays)."""
        tier = self.tier
        if tier is None:
            return False
        if tier.cold_bytes() > 0:
            return True
        return any(len(s) + incoming > tier.floor_hot_budget(i) for i, s in enumerate(self.stores))

    def rollback(self, start: int) -> None:
        """Forget the tokens at positions >= ``start`` (the probe) in every layer."""
        for layer, store in enumerate(self.stores):
            store.keep(store.meta("pos") < start)
            store.next_pos = start
            if self.tier is not None:
                self.tier.cold[layer].forget_from(start)
            self._refresh_bytes(layer)

    def recall_voted(self, incoming: int = 0) -> int:
        """After a probe (rolled back; ``incoming`` prompt tokens are still to come): re-select
        every layer's hot set by the probe's importance (``RecallTier.importance``, summed over
        layers): the most important hot tokens and cold pages (at most ``rtok`` recalled
        tokens) fill the slots the protected tokens and the incoming tail leave; they are
        pinned for ``hold`` positions after the tail, and what they displace goes cold."""
        tier = self.tier
        if tier is None:
            return 0
        tier.mode = RecallMode.SWAP
        protect_from = self.seen_tokens + incoming - self.policy.protected
        g = tier.importance(self.seen_tokens, (self.policy.s, protect_from))
        until = self.seen_tokens + incoming + self.policy.hold
        n = 0
        for layer, store in enumerate(self.stores):
            # fit the confident-step budget: what the first answer step trims to keeps the choice
            # (page summaries that the trim opens included)
            floor = tier.floor_hot_budget(layer, self.seen_tokens + incoming + 1)
            budget = min(self.hot_budget(layer), floor)
            pos = store.meta("pos")
            protected = (pos >= protect_from) | (pos < self.policy.s)
            # the tail, then the first answer token (and the eviction slack) arrive on top
            capacity = budget - int(protected.sum()) - incoming - 1 - self.policy.slack
            if capacity <= 0:
                continue
            keep, slots = tier.reselect(layer, store, g, protected, capacity, tier.swap_tokens(budget))
            store.pin(keep & ~protected, until)
            if slots.numel():
                n += self._bring_back(layer, tier._take(layer, store, slots, until))
        tier.clear_probe()
        tier.mode = RecallMode.NONE
        return n
