"""``h2o:n=N`` (Heavy-Hitter Oracle): the most-attended tokens so far plus a recent window.

``recent`` tokens (default n/2, as in the H2O paper) are protected; the rest of the budget goes
to the largest cumulative received attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from confkv.budgets import FixedBudget
from confkv.policies.base import CachePolicy
from confkv.policies.select import TokenStats


@dataclass(frozen=True)
class H2OPolicy(CachePolicy):
    name: ClassVar[str] = "h2o"
    needs_attention: ClassVar[bool] = True
    n: int = 512
    recent: int | None = None

    def __post_init__(self) -> None:
        if self.recent is None:
            object.__setattr__(self, "recent", self.n // 2)
        if not 0 <= self.recent_tokens < self.n:
            raise ValueError(f"h2o: need 0 <= recent < n, got recent={self.recent}, n={self.n}")
        super().__post_init__()

    @property
    def recent_tokens(self) -> int:
        """``recent`` once resolved (``__post_init__`` fills the n/2 default)."""
        return self.n // 2 if self.recent is None else self.recent

    @property
    def protected(self) -> int:
        return max(self.p, self.recent_tokens)

    def budget_rule(self) -> FixedBudget:
        return FixedBudget(self.n)

    def score(self, stats: TokenStats) -> torch.Tensor:
        return stats.cumulative + 1e-6 * stats.recency()

    def scaled_to_peak(self, tokens: int) -> CachePolicy:
        return self.replace(n=tokens, recent=tokens // 2)
