"""``window:n=N``: the last N tokens (sliding window)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from confkv.budgets import FixedBudget
from confkv.policies.base import CachePolicy
from confkv.policies.select import TokenStats


@dataclass(frozen=True)
class WindowPolicy(CachePolicy):
    name: ClassVar[str] = "window"
    n: int = 512

    def budget_rule(self) -> FixedBudget:
        return FixedBudget(self.n)

    def score(self, stats: TokenStats) -> torch.Tensor:
        return stats.positions.float()

    def scaled_to_peak(self, tokens: int) -> CachePolicy:
        return self.replace(n=tokens)
