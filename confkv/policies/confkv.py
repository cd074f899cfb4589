"""``confkv``: confidence-gated budget; rank by alpha * norm(EMA attention) + (1 - alpha) * recency.

``norm`` says how the EMA is brought to [0, 1] before it is mixed with recency:
``max`` divides by the largest EMA in the layer. Attention sinks (the first ``s`` tokens, never
evicted) hold most of the mass, so every other token lands near 0 and recency decides nearly
alone. ``free`` divides by the largest EMA among the tokens that may be evicted. ``rank`` uses
each token's rank by EMA (0 = least attended, 1 = most), so the mix does not depend on how
heavy-tailed attention is.

``attn`` picks the received-attention signal that is normalized: ``ema`` (default), ``sum`` (the
plain sum, H2O's signal) or ``mean`` (that sum over the token's age).

``vn=1`` weights the received-attention signal by the token's value norm before it is
normalized (VATP, Guo et al. 2024: a token's contribution to the attention output is its weight
times its value; attention sinks draw weight but carry small values).

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
ATTNS = ("ema", "sum", "mean")


@dataclass(frozen=True)
class ConfKVPolicy(GatedPolicy):
    name: ClassVar[str] = "confkv"
    needs_attention: ClassVar[bool] = True
    alpha: float = 0.9  # tuned on Emma: mostly EMA attention, recency breaks ties
    norm: str = "max"
    pool: int = 1
    # ema: the EMA of received attention (decay); sum: its plain sum, as H2O ranks; mean: the sum
    # over the token's age (steps since it was written)
    attn: str = "ema"
    vn: bool = False  # weight received attention by the value's L1 norm (VATP)
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
        if self.attn not in ATTNS:
            raise ValueError(f"confkv: attn is one of {', '.join(ATTNS)}, not {self.attn!r}")
        if self.pool < 1 or self.pool % 2 == 0:
            raise ValueError(f"confkv: pool must be an odd number >= 1, got {self.pool}")

    @property
    def needs_values(self) -> bool:
        return self.vn

    def score(self, stats: TokenStats) -> torch.Tensor:
        score = self.alpha * self._attention(stats) + (1 - self.alpha) * stats.recency()
        return score if self.pool == 1 else _pooled(score, stats.positions, self.pool, stats.valid)

    def _attention(self, stats: TokenStats) -> torch.Tensor:
        got = _received(stats, self.attn)
        if self.vn:
            if stats.value_norm is None:
                raise ValueError("confkv: vn=1 scores need TokenStats.value_norm")
            got = got * stats.value_norm
        if self.norm == "rank":
            n = got.shape[-1]
            order = (got if stats.valid is None else got.masked_fill(~stats.valid, -float("inf"))).argsort(
                dim=-1, stable=True
            )
            slots = torch.arange(n, dtype=torch.float32, device=got.device).expand_as(got)
            ranks = torch.empty_like(got, dtype=torch.float32).scatter_(-1, order, slots)
            live = stats.live()
            if stats.valid is not None:  # padding ranked first: a row's live slots rank from 0
                ranks = ranks - (n - live)
            return ranks / (live - 1).clamp_min(1)
        top = stats.row_max(got)
        if self.norm == "free":
            free = ~protected_mask(stats.positions, stats.now - self.protected, self.s)
            if stats.valid is not None:
                free &= stats.valid
            top = torch.where(free.any(-1, keepdim=True), stats.row_max(got, where=free), top)
        return got / top.clamp_min(1e-12)


def _received(stats: TokenStats, attn: str) -> torch.Tensor:
    if attn == "ema":
        return stats.ema
    if attn == "sum":
        return stats.cumulative
    return stats.cumulative / (stats.now - stats.positions).clamp_min(1).float()


def _pooled(score: torch.Tensor, positions: torch.Tensor, k: int, valid: torch.Tensor | None) -> torch.Tensor:
    """(..., n) each token's max score over the ``k`` kept tokens centred on it in position
    order (padding past a row's live slots sorts last and never wins)."""
    if valid is not None:
        positions = positions.masked_fill(~valid, torch.iinfo(positions.dtype).max)
        score = score.masked_fill(~valid, -float("inf"))
    order = positions.argsort(dim=-1)
    ranked = score.gather(-1, order)
    rows = ranked.reshape(-1, 1, ranked.shape[-1])
    pooled = torch.nn.functional.max_pool1d(rows, k, stride=1, padding=k // 2).view_as(ranked)
    return torch.empty_like(score).scatter_(-1, order, pooled)
