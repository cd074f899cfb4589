"""``confkv``: confidence-gated budget; rank by alpha * norm(EMA attention) + (1 - alpha) * recency.

``norm`` says how the EMA is brought to [0, 1] before it is mixed with recency:
``max`` divides by the largest EMA in the layer. Attention sinks (the first ``s`` tokens, never
evicted) hold most of the mass, so every other token lands near 0 and recency decides nearly
alone. ``free`` divides by the largest EMA among the tokens that may be evicted. ``rank`` uses
each token's rank by EMA (0 = least attended, 1 = most), so the mix does not depend on how
heavy-tailed attention is.

``pool=K`` (odd, default 1: off) max-pools the score over each token's K nearest kept neighbours
by position (as SnapKV pools its votes), so a heavily attended token keeps the span around it and
eviction removes whole low-scored spans instead of scattering holes through the text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from confkv.policies.base import GatedPolicy
from confkv.policies.select import TokenStats, protected_mask

NORMS = ("max", "free", "rank")


@dataclass(frozen=True)
class ConfKVPolicy(GatedPolicy):
    name: ClassVar[str] = "confkv"
    needs_attention: ClassVar[bool] = True
    alpha: float = 0.9  # tuned on Emma: mostly EMA attention, recency breaks ties
    norm: str = "max"
    pool: int = 1
    # With recall=1 a fact comes back through the cold tier, so the ranking can serve reading:
    # the EMA by rank, gentler confident-step pruning and span pooling (dev perplexity 25.10 vs
    # 25.26, dev agent recall 93% of full; reports/REPRODUCTION.md, "The probe's vote and the
    # recall defaults").
    RECALL_DEFAULTS: ClassVar[dict[str, object]] = {"norm": "rank", "n_low": 480, "pool": 5}

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"confkv: alpha must be in [0, 1], got {self.alpha}")
        if self.norm not in NORMS:
            raise ValueError(f"confkv: norm is one of {', '.join(NORMS)}, not {self.norm!r}")
        if self.pool < 1 or self.pool % 2 == 0:
            raise ValueError(f"confkv: pool must be an odd number >= 1, got {self.pool}")

    def score(self, stats: TokenStats) -> torch.Tensor:
        score = self.alpha * self._attention(stats) + (1 - self.alpha) * stats.recency()
        return score if self.pool == 1 else _pooled(score, stats.positions, self.pool)

    def _attention(self, stats: TokenStats) -> torch.Tensor:
        ema = stats.ema
        if self.norm == "rank":
            n = ema.shape[0]
            ranks = torch.empty(n, dtype=torch.float32, device=ema.device)
            ranks[ema.argsort()] = torch.arange(n, dtype=torch.float32, device=ema.device)
            return ranks / max(n - 1, 1)
        if self.norm == "free":
            free = ~protected_mask(stats.positions, stats.now - self.protected, self.s)
            if bool(free.any()):
                return ema / ema[free].max().clamp_min(1e-12)
        return ema / ema.max().clamp_min(1e-12)


def _pooled(score: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """(n,) each token's max score over the ``k`` kept tokens centred on it in position order."""
    order = positions.argsort()
    ranked = score[order].view(1, 1, -1)
    pooled = torch.nn.functional.max_pool1d(ranked, k, stride=1, padding=k // 2).view(-1)
    out = torch.empty_like(score)
    out[order] = pooled
    return out
