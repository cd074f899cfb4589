"""Recall: when to read the cold tier, which pages to bring back, and how they enter the hot set.

Triggers (the policy's ``recall_trigger``):
  prompt end  always: the last ``obs`` queries of a prompt's final chunk (the question, as
              SnapKV's observation window) score the cold pages in every layer before that
              chunk attends; up to ``rtok`` tokens are *swapped* in (the lowest-scored hot
              tokens go cold), so the hot set keeps its size.
  gate        confkv: an unsure step (c < tau) gets the n_high budget and the room above the
              hot set is *filled* with recalled pages; confident steps read nothing cold.
  random/every  the matched-rate controls: the same fill (gated policies) or swap (others) on
              steps drawn at ``rate`` / every ``every`` steps.
Page choice: score = max over query heads and obs queries of scaling * ub(q, page) - lse(q),
an upper bound of the log attention weight the page's best key would get relative to the
current hot set (``confkv_kernels.page_scores``). Pages are taken best first while they fit.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
from confkv_kernels.reference import dequantize_int8_ref

from confkv.cold import ColdStore
from confkv.memory import KVGeometry
from confkv.policies import CachePolicy, GatedPolicy
from confkv.storage import LayerStore

SUMMARY_SHARE = 0.25  # page summaries may take at most this share of a layer's smallest budget


class RecallMode(enum.Enum):
    NONE = "none"
    SWAP = "swap"  # keep the hot size: recalled tokens replace the lowest-scored ones
    FILL = "fill"  # fill the free room up to the budget (gated unsure steps)


@dataclass
class RecallEvent:
    """One layer's recall at one step (for traces): mode, pages and tokens brought back."""

    position: int
    layer: int
    mode: str
    pages: int
    tokens: int


def hot_lse(store: LayerStore, q: torch.Tensor, scaling: float) -> torch.Tensor:
    """q (Hq, M, D) -> (Hq, M) float32 log-sum-exp of the logits over the hot keys."""
    k8, k8s, _, _, kf, _ = store.kv_views()
    keys = torch.cat([dequantize_int8_ref(k8, k8s, torch.float32), kf.float()], dim=1)  # (Hkv, N, D)
    hq, m, d = q.shape
    hkv = keys.shape[0]
    if keys.shape[1] == 0:
        return torch.full((hq, m), float("-inf"), device=q.device)
    qg = q.float().reshape(hkv, (hq // hkv) * m, d)
    return (torch.bmm(qg, keys.transpose(1, 2)) * scaling).logsumexp(-1).reshape(hq, m)


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
        self.cold = [ColdStore(geometry, policy.page, device) for _ in range(geometry.n_layers)]
        self.generator = generator
        self.mode = RecallMode.NONE
        self.steps = 0
        self.events: list[RecallEvent] = []
        self.recalled_tokens = 0
        self.trigger_steps = 0
        slot = geometry.int8_token_bytes if policy.int8 else geometry.fp_token_bytes
        self.slot_bytes = slot
        floor = policy.n_low if isinstance(policy, GatedPolicy) else policy.budget_rule().peak
        floors = policy.layer_budgets(floor, geometry.n_layers)
        page_bytes = self.cold[0].page_summary_bytes
        self.max_pages = [max(1, int(SUMMARY_SHARE * f * slot) // page_bytes) for f in floors]
        per_layer = policy.cold_bytes // geometry.n_layers if policy.cold_bytes else None
        self.max_cold_tokens = per_layer // geometry.int8_token_bytes if per_layer else 1 << 62

    # -- sizes -------------------------------------------------------------------------------------
    def summary_tokens(self, layer: int) -> int:
        """Hot token slots the layer's page summaries stand in for (they share the budget)."""
        return math.ceil(self.cold[layer].summary_bytes() / self.slot_bytes)

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
        gated = isinstance(self.policy, GatedPolicy)
        self.mode = (RecallMode.FILL if gated else RecallMode.SWAP) if fire else RecallMode.NONE
        self.trigger_steps += int(fire)
        return fire

    def swap_tokens(self, layer_budget: int) -> int:
        return self.policy.rtok or max(1, layer_budget // 4)

    # -- store hooks ------------------------------------------------------------------------------------
    def add_evicted(self, layer: int, tokens: dict[str, torch.Tensor]) -> int:
        """Evicted tokens go cold; returns the tokens the bounded cold tier had to drop."""
        if not tokens:
            return 0
        cold = self.cold[layer]
        cold.add(tokens)
        return cold.drop_to(self.max_pages[layer], self.max_cold_tokens)

    def take(self, layer: int, q: torch.Tensor, store: LayerStore, scaling: float, room: int):
        """Score layer ``layer``'s cold pages with the obs queries of q (Hq, M, D) and take the
        best ones that fit in ``room`` tokens -> tokens (INT8 layout, pinned) or None."""
        cold = self.cold[layer]
        if room <= 0 or cold.n_tokens == 0:
            return None
        q_obs = q[:, -self.policy.obs :]
        scores = cold.scores(q_obs, hot_lse(store, q_obs, scaling), scaling)
        slots = choose_pages(scores, cold.page_counts(), room)
        if slots.numel() == 0:
            return None
        tokens = cold.take(slots)
        n = tokens["pos"].shape[0]
        tokens["pin"] = torch.full((n,), store.next_pos + self.policy.hold, dtype=torch.long, device=q.device)
        self.recalled_tokens += n
        self.events.append(RecallEvent(store.next_pos, layer, self.mode.value, int(slots.numel()), n))
        return tokens

    def pop_events(self) -> list[RecallEvent]:
        events, self.events = self.events, []
        return events
