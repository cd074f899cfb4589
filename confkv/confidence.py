"""Next-token confidence from logits (DESIGN.md):

    c = w_ent * (1 - H(p)/log|V|) + w_margin * sigmoid(logp1 - logp2) + w_top1 * max(p)

All three terms lie in [0, 1] so c does too when the weights sum to 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ConfidenceWeights:
    entropy: float = 0.4
    margin: float = 0.3
    top1: float = 0.3

    def __post_init__(self) -> None:
        values = (self.entropy, self.margin, self.top1)
        if any(v < 0 for v in values):
            raise ValueError(f"confidence weights must be >= 0, got {values}")
        if not math.isclose(sum(values), 1.0, abs_tol=1e-6):
            raise ValueError(f"confidence weights must sum to 1, got {values} (sum {sum(values)})")


def confidence(logits: torch.Tensor, weights: ConfidenceWeights = ConfidenceWeights()) -> torch.Tensor:
    """logits (..., V) -> confidence (...) in [0, 1], float32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    entropy = -(p * logp).sum(-1)
    vocab = logits.shape[-1]
    norm_entropy = entropy / math.log(vocab) if vocab > 1 else torch.zeros_like(entropy)
    top2 = logp.topk(2, dim=-1).values if vocab > 1 else torch.cat([logp, logp - 1e9], -1)
    margin = torch.sigmoid(top2[..., 0] - top2[..., 1])
    top1 = top2[..., 0].exp()
    return weights.entropy * (1 - norm_entropy) + weights.margin * margin + weights.top1 * top1
