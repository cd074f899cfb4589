"""``confkv``: confidence-gated budget; rank by alpha * norm(EMA attention) + (1 - alpha) * recency."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from confkv.policies.base import GatedPolicy
from confkv.policies.select import TokenStats


@dataclass(frozen=True)
class ConfKVPolicy(GatedPolicy):
    name: ClassVar[str] = "confkv"
    needs_attention: ClassVar[bool] = True
    alpha: float = 0.9  # tuned on Emma: mostly EMA attention, recency breaks ties

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"confkv: alpha must be in [0, 1], got {self.alpha}")

    def score(self, stats: TokenStats) -> torch.Tensor:
        ema = stats.ema / stats.ema.max().clamp_min(1e-12)
        return self.alpha * ema + (1 - self.alpha) * stats.recency()
