"""The one place where protected tokens, sinks and the budget are applied (STYLE: shared select)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenStats:
    """What a policy may look at when scoring one layer's kept tokens (n of them).

    positions (n,) int64 absolute positions; ema (n,) float32 EMA of received attention mass;
    cumulative (n,) float32 summed attention mass (H2O); now = position of the next token.
    """

    positions: torch.Tensor
    ema: torch.Tensor
    cumulative: torch.Tensor
    now: int
    generator: torch.Generator | None = None

    def recency(self) -> torch.Tensor:
        """(n,) in [0, 1]: 1 for the newest kept token, 0 for the oldest."""
        pos = self.positions.float()
        lo, hi = pos.min(), pos.max()
        return (pos - lo) / (hi - lo).clamp_min(1.0)


def protected_mask(positions: torch.Tensor, protect_from: int, sinks: int) -> torch.Tensor:
    """(n,) True for tokens that are never evicted: the recent window (positions >= ``protect_from``)
    and the attention sinks (positions < ``sinks``)."""
    return (positions >= protect_from) | (positions < sinks)


def select_keep(
    scores: torch.Tensor, positions: torch.Tensor, keep: int, protect_from: int, sinks: int
) -> torch.Tensor:
    """Boolean mask (n,) of tokens to keep: the ``keep`` best-scored, never dropping protected ones.

    Protected: positions >= ``protect_from`` (the recent window P) and positions < ``sinks``.
    If more tokens are protected than ``keep``, all protected tokens are kept.
    """
    n = scores.shape[0]
    if n <= keep:
        return torch.ones(n, dtype=torch.bool, device=scores.device)
    protected = protected_mask(positions, protect_from, sinks)
    ranked = scores.float().masked_fill(protected, float("inf"))
    k = max(keep, int(protected.sum()))
    mask = torch.zeros(n, dtype=torch.bool, device=scores.device)
    if k > 0:
        mask[ranked.topk(k, sorted=False).indices] = True
    return mask
