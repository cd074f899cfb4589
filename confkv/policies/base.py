"""Cache policy base: what to keep (``score``), how many (``budget_rule``), where (per layer).

A policy is a frozen, validated dataclass. Subclasses write ``score`` and, if they have a
schedule of their own, ``budget_rule``; the cache applies them through ``select_keep`` once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from confkv.budgets import FixedBudget, GatedBudget, pyramid_split
from confkv.confidence import ConfidenceWeights
from confkv.memory import KVGeometry
from confkv.policies.select import TokenStats

# Cold pages are aligned to positions and allocated whole (``confkv.cold``), so a page much larger
# than what is evicted would hold mostly empty slots in host memory.
MAX_PAGE = 1024


@dataclass(frozen=True)
class CachePolicy:
    """Fields shared by every policy.

    p: recent tokens never evicted; s: first tokens never evicted (attention sinks);
    int8: store tokens older than ``w`` positions as INT8; pyramid/slope: deeper layers get
    smaller budgets with the same total; decay: EMA decay of received attention;
    bytes: optional peak KV byte budget that overrides the token budgets (resolved per model);
    slack: when eviction has to run, evict this many extra tokens so it runs about every
    ``slack`` steps instead of every step (a speed knob; the mean cache shrinks by ~slack/2);
    with ``int8`` the FP window is likewise demoted ``slack`` tokens ahead, so INT8 demotion
    runs about every ``slack`` steps too (the FP window holds up to ``slack`` fewer tokens).

    Recall tier (``recall=1``, storage like ``int8``, orthogonal to ranking; confkv/recall.py):
    evicted tokens move to INT8 cold pages of ``page`` positions instead of being dropped. At the
    end of every prompt / new turn the last ``obs`` prompt tokens probe every hot and cold token
    in every layer (``vote=sum``: their attention mass, summed over heads, queries and layers;
    ``vote=last``: the last query's weights head by head, the largest over heads and layers, so
    a retrieval head that points at a fact ranks it first); each layer's hot set is re-selected
    by that importance:
    the most important hot tokens and cold pages (at most ``rtok`` recalled tokens; 0: half the
    layer budget, at least a page) take the slots the protected tokens leave. On decode steps
    ``trigger`` decides:
    ``prompt`` (the default: prompt ends only), ``gate`` (confkv: an unsure step fills the
    n_high - n_low room with the pages whose key bounds score best; with n_low = n_high it swaps
    them, at most ``stok`` tokens (0: as ``rtok``), for the lowest-scored hot ones), ``random``
    (steps drawn at ``rate``) or ``every`` (every ``every`` steps). Recalled tokens are pinned for ``hold``
    positions. ``cold_bytes`` bounds the cold tier per sequence (the least attended pages are
    dropped and counted). The decode-step triggers score pages by key bounds kept on the hot
    device (page summaries, counted as hot bytes); a ``prompt`` tier keeps none.
    """

    name: ClassVar[str] = "base"
    evicts: ClassVar[bool] = True
    needs_attention: ClassVar[bool] = False
    # ``score`` works on rows of several sequences (``TokenStats.valid``), each bit for bit as
    # alone, so a decode batch evicts in one call per step (``confkv.evict_rows``)
    scores_rows: ClassVar[bool] = True

    # whether ``score`` reads ``TokenStats.value_norm`` (computed from the stored values only then)
    @property
    def needs_values(self) -> bool:
        return False

    # keys whose default differs when a spec says recall=1 (``parse_policy`` applies them)
    RECALL_DEFAULTS: ClassVar[dict[str, object]] = {}

    p: int = 0
    s: int = 0
    int8: bool = False
    w: int = 128
    pyramid: bool = False
    slope: float = 0.5
    decay: float = 0.9
    bytes: int | None = None
    slack: int = 0
    recall: bool = False
    page: int = 32
    rtok: int = 0
    stok: int = 0  # tokens a decode-step swap brings back (0: as rtok)
    obs: int = 32
    hold: int = 16
    trigger: str | None = None  # gate | prompt | random | every
    rate: float = 0.0
    every: int = 0
    cold_bytes: int | None = None
    vote: str = "last"  # last | sum: how the prompt-end probe scores tokens (confkv/recall.py)

    def __post_init__(self) -> None:
        if self.p < 0 or self.s < 0:
            raise ValueError(f"{self.name}: p and s must be >= 0, got p={self.p}, s={self.s}")
        if self.w < 1:
            raise ValueError(f"{self.name}: the FP window w must be >= 1, got {self.w}")
        if not 0.0 <= self.slope < 1.0:
            raise ValueError(f"{self.name}: slope must be in [0, 1), got {self.slope}")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"{self.name}: decay must be in [0, 1), got {self.decay}")
        if self.slack < 0:
            raise ValueError(f"{self.name}: slack must be >= 0, got {self.slack}")
        if self.bytes is not None and self.bytes <= 0:
            raise ValueError(f"{self.name}: bytes must be positive, got {self.bytes}")
        self._validate_recall()
        if self.evicts and self.budget_rule().peak < self.min_tokens:
            raise ValueError(
                f"{self.name}: budget {self.budget_rule().peak} is smaller than the protected "
                f"tokens p+s+1={self.min_tokens}"
            )

    def _validate_recall(self) -> None:
        if not self.recall:
            return
        if not self.evicts:
            raise ValueError(f"{self.name}: recall=1 needs an evicting policy ({self.name} keeps everything)")
        if self.page < 1 or self.obs < 1 or min(self.hold, self.rtok, self.stok, self.every) < 0:
            raise ValueError(f"{self.name}: page and obs must be >= 1, hold, rtok, stok and every >= 0")
        if self.page > MAX_PAGE:  # pages are position-aligned: a cold page holds `page` slots
            raise ValueError(f"{self.name}: page must be <= {MAX_PAGE} positions, got {self.page}")
        if self.trigger not in (None, "gate", "prompt", "random", "every"):
            raise ValueError(
                f"{self.name}: trigger is one of gate, prompt, random or every, not {self.trigger!r}"
            )
        if self.recall_trigger == "gate" and not isinstance(self, GatedPolicy):
            raise ValueError(f"{self.name}: trigger=gate needs a confidence-gated policy (confkv, ablations)")
        if self.recall_trigger == "random" and not 0.0 < self.rate <= 1.0:
            raise ValueError(f"{self.name}: trigger=random needs 0 < rate <= 1, got {self.rate}")
        if self.recall_trigger == "every" and self.every < 1:
            raise ValueError(f"{self.name}: trigger=every needs every >= 1")
        # keys of a trigger the spec does not use would do nothing: say so instead
        for key, needs in (("rate", "random"), ("every", "every")):
            if getattr(self, key) and self.recall_trigger != needs:
                raise ValueError(f"{self.name}: {key} applies only with trigger={needs}")
        if self.stok and self.recall_trigger == "prompt":
            raise ValueError(
                f"{self.name}: stok sizes decode-step swaps: it needs trigger=gate, random or every"
            )
        if self.cold_bytes is not None and self.cold_bytes <= 0:
            raise ValueError(f"{self.name}: cold_bytes must be positive, got {self.cold_bytes}")
        if self.vote not in ("sum", "last"):
            raise ValueError(f"{self.name}: vote is sum or last, not {self.vote!r}")

    @property
    def recall_trigger(self) -> str:
        """The decode-step trigger: the spec's, else ``prompt`` (prompt ends only: decode-time
        recall answered no more than the prompt-end probe alone, within one item per set, and
        cost time and the page summaries' hot slots; reports/REPRODUCTION.md, "The default
        trigger")."""
        return self.trigger if self.trigger is not None else "prompt"

    # -- what subclasses provide -------------------------------------------------------------
    def budget_rule(self) -> FixedBudget | GatedBudget:
        raise NotImplementedError

    def score(self, stats: TokenStats) -> torch.Tensor:
        """(n,) higher = keep. Only called when tokens must be evicted."""
        raise NotImplementedError

    def scaled_to_peak(self, tokens: int) -> CachePolicy:
        """A copy whose peak token budget is ``tokens`` (other budgets scaled alike)."""
        raise NotImplementedError

    # -- shared behaviour ----------------------------------------------------------------------
    @property
    def protected(self) -> int:
        """Recent tokens that are never evicted."""
        return self.p

    @property
    def min_tokens(self) -> int:
        return self.protected + self.s + 1

    def layer_budgets(self, total: int, n_layers: int) -> list[int]:
        if self.pyramid:
            return pyramid_split(total, n_layers, self.slope, minimum=self.min_tokens)
        return [total] * n_layers

    def peak_bytes_bound(self, geometry: KVGeometry) -> int:
        budgets = self.layer_budgets(self.budget_rule().peak, geometry.n_layers)
        return geometry.bytes_bound(budgets, self.int8, self.w)

    def worst_case_bytes(self, geometry: KVGeometry, context_tokens: int) -> int:
        """Most KV bytes a session of ``context_tokens`` tokens can hold: the policy's peak bound,
        never more than a full cache of that context (what a ``full`` session grows to)."""
        full = geometry.full_bytes(context_tokens)
        if not self.evicts:
            return full
        return min(self.resolve(geometry).peak_bytes_bound(geometry), full)

    def worst_case_cold_bytes(self, geometry: KVGeometry, context_tokens: int) -> int:
        """Most cold-tier (host) bytes a session of ``context_tokens`` tokens can hold: every page
        of positions seen, in INT8, in every layer (a cold tier allocates whole position-aligned
        pages, at most one per page of positions: ``ColdStore.reserved_bytes``), at most the
        whole pages ``cold_bytes`` holds (``cold_slots_per_layer``); 0 without ``recall=1``."""
        if not self.recall:
            return 0
        pages = -(-context_tokens // self.page)
        slots = self.cold_slots_per_layer(geometry)
        if slots is not None:
            pages = min(pages, slots)
        return pages * self.page * geometry.int8_token_bytes * geometry.n_layers

    def cold_slots_per_layer(self, geometry: KVGeometry) -> int | None:
        """Page slots one layer's cold tier may allocate under ``cold_bytes`` (split evenly over
        the layers; a slot holds ``page`` INT8 tokens); None without a bound."""
        if self.cold_bytes is None:
            return None
        return self.cold_bytes // geometry.n_layers // (self.page * geometry.int8_token_bytes)

    def _peak_bytes_at(self, tokens: int, geometry: KVGeometry) -> int | None:
        """Peak bytes when scaled to ``tokens``; None when that budget cannot be split over the
        layers (a pyramid needs somewhat more than ``min_tokens`` per layer on average)."""
        try:
            return self.replace(bytes=None).scaled_to_peak(tokens).peak_bytes_bound(geometry)
        except ValueError:
            return None

    def resolve(self, geometry: KVGeometry) -> CachePolicy:
        """Turn a byte budget into token budgets for this model (largest that fits)."""
        if self.bytes is None or not self.evicts:
            return self
        lo = 1  # min_tokens may depend on the budget itself (h2o's recent = n/2)
        while self._peak_bytes_at(lo, geometry) is None and lo < 1 << 24:
            lo += max(1, lo // 8)

        limit = self.bytes

        def fits(n: int) -> bool:
            bound = self._peak_bytes_at(n, geometry)
            return bound is not None and bound <= limit

        if not fits(lo):
            raise ValueError(f"{self.name}: bytes={self.bytes} cannot hold even {lo} tokens per layer")
        hi = lo
        while fits(hi * 2):
            hi *= 2
        hi *= 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return self.replace(bytes=None).scaled_to_peak(lo)

    def replace(self, **changes) -> CachePolicy:
        return dataclasses.replace(self, **changes)

    @classmethod
    def defaults(cls, recall: bool = False) -> dict[str, object]:
        """Every key's default; with ``recall=1`` the policy's ``RECALL_DEFAULTS`` replace some."""
        base = {f.name: f.default for f in dataclasses.fields(cls)}
        return {**base, **cls.RECALL_DEFAULTS} if recall else base

    def spec(self) -> str:
        """Canonical spec string: name plus every field that differs from its default (the
        recall defaults when ``recall=1``), so ``parse_policy(p.spec()) == p``."""
        parts = []
        defaults = self.defaults(self.recall)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != defaults[f.name]:
                parts.append(f"{f.name}={int(value) if isinstance(value, bool) else value}")
        return self.name + (":" + ",".join(parts) if parts else "")


@dataclass(frozen=True)
class GatedPolicy(CachePolicy):
    """Policies on Conf-KV's confidence-gated schedule (confkv and its matched-rate ablations)."""

    n_high: int = 512
    n_low: int = 448  # tuned on Emma (reports/tune_emma_1024.md): gentle pruning wins at equal peak bytes
    tau: float = 0.5
    p: int = 64
    s: int = 4
    w_ent: float = 0.4
    w_margin: float = 0.3
    w_top1: float = 0.3

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_low < self.min_tokens:
            raise ValueError(f"{self.name}: n_low={self.n_low} is smaller than p+s+1={self.min_tokens}")
        self.confidence_weights()  # validates

    def confidence_weights(self) -> ConfidenceWeights:
        return ConfidenceWeights(self.w_ent, self.w_margin, self.w_top1)

    def budget_rule(self) -> GatedBudget:
        return GatedBudget(self.n_high, self.n_low, self.tau)

    def scaled_to_peak(self, tokens: int) -> CachePolicy:
        n_low = max(self.min_tokens, round(self.n_low * tokens / self.n_high))
        return self.replace(n_high=tokens, n_low=min(n_low, tokens))
