"""``sinks:s=S,n=N`` (StreamingLLM): the first S tokens plus the last N-S."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from confkv.budgets import FixedBudget
from confkv.policies.base import CachePolicy
from confkv.policies.select import TokenStats


@dataclass(frozen=True)
class SinksPolicy(CachePolicy):
    name: ClassVar[str] = "sinks"
    s: int = 4
    n: int = 512

    def budget_rule(self) -> FixedBudget:
        return FixedBudget(self.n)

    def score(self, stats: TokenStats) -> torch.Tensor:
        return stats.positions.float()  # sinks are protected by select_keep; the rest is a window

    def scaled_to_peak(self, tokens: int) -> CachePolicy:
        return self.replace(n=tokens)
