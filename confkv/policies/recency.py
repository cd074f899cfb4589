"""``recency``: Conf-KV's exact eviction schedule, keep the newest (ablation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from confkv.policies.base import GatedPolicy
from confkv.policies.select import TokenStats


@dataclass(frozen=True)
class RecencyPolicy(GatedPolicy):
    name: ClassVar[str] = "recency"

    def score(self, stats: TokenStats) -> torch.Tensor:
        return stats.positions.float()
