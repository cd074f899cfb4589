"""One sequence's Conf-KV state: its policy, per-layer stores, budget and byte statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from confkv.confidence import ConfidenceWeights
from confkv.memory import KVGeometry
from confkv.policies import CachePolicy, TokenStats, select_keep
from confkv.storage import LayerStore


@dataclass
class StepRecord:
    """What happened at one decoding step (for traces)."""

    confidence: float | None
    budget: int
    tokens_per_layer: list[int]
    bytes_per_layer: list[int]


@dataclass
class SequenceStats:
    peak_bytes: int = 0
    evicted_tokens: int = 0
    evictions_per_step: list[int] = field(default_factory=list)


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
        self.layer_bytes = [0] * geometry.n_layers
        self._total_bytes = 0
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
        self.set_budget(self.rule(self.last_confidence))
        return self.budget

    # -- sizes -------------------------------------------------------------------------------------
    @property
    def seen_tokens(self) -> int:
        return self.stores[0].next_pos

    def nbytes(self) -> int:
        return self._total_bytes

    def tokens_per_layer(self) -> list[int]:
        return [len(s) for s in self.stores]

    def record(self) -> StepRecord:
        return StepRecord(self.last_confidence, self.budget, self.tokens_per_layer(), list(self.layer_bytes))

    def _refresh_bytes(self, layer: int) -> None:
        now = self.stores[layer].nbytes_fast()
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
        positions = store.meta("pos")
        stats = TokenStats(positions, store.meta("ema"), store.meta("cum"), store.next_pos, self.generator)
        scores = self.policy.score(stats)
        mask = select_keep(scores, positions, keep, store.next_pos - self.policy.protected, self.policy.s)
        store.keep(mask)
        evicted = n - len(store)
        self.stats.evicted_tokens += evicted
        self._evicted_this_step += evicted
        self._refresh_bytes(layer)
        return evicted

    def before_append(self, layer: int, incoming: int) -> None:
        """Make room so that the layer holds at most its budget, and at most ``w`` FP tokens
        (INT8 policies), after ``incoming`` tokens arrive: peak bytes stay within the bound."""
        budget = self.layer_budgets[layer]
        if len(self.stores[layer]) + incoming > budget:
            self.evict_to(layer, budget - incoming - self.policy.slack)
        self.stores[layer].demote_old(incoming)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.stores[layer].append(k, v)
        self._refresh_bytes(layer)

    def after_attention(self, layer: int, mass8: torch.Tensor, massf: torch.Tensor) -> None:
        """EMA update, then evict what a prompt chunk larger than the free room overflowed."""
        store = self.stores[layer]
        if self.policy.needs_attention:
            store.add_attention(mass8, massf, self.policy.decay)
        self.evict_to(layer, self.layer_budgets[layer])
        # before_append already demoted everything the window lets go of; FP tokens can only be
        # out of the window here when a chunk longer than the window arrived in one piece.
        if store.int8 and store.fp.n > store.window:
            store.demote_old()
            self._refresh_bytes(layer)
