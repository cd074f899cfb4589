"""``random``: Conf-KV's exact eviction schedule, victims drawn uniformly (ablation floor)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from confkv.policies.base import GatedPolicy
from confkv.policies.select import TokenStats


@dataclass(frozen=True)
class RandomPolicy(GatedPolicy):
    name: ClassVar[str] = "random"
    scores_rows: ClassVar[bool] = False  # one draw from each sequence's own generator
    seed: int = 0

    def score(self, stats: TokenStats) -> torch.Tensor:
        n = stats.positions.shape[0]
        return torch.rand(n, generator=stats.generator, device="cpu").to(stats.positions.device)
