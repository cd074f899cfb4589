"""``attention``: Conf-KV's exact eviction schedule, keep the highest EMA attention (ablation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from confkv.policies.base import GatedPolicy
from confkv.policies.select import TokenStats


@dataclass(frozen=True)
class AttentionPolicy(GatedPolicy):
    name: ClassVar[str] = "attention"
    needs_attention: ClassVar[bool] = True

    def score(self, stats: TokenStats) -> torch.Tensor:
        return stats.ema + 1e-9 * stats.recency()  # recency only breaks exact ties
