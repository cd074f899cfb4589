"""The one place where protected tokens, sinks and the budget are applied (STYLE: shared select).

Scores and selection work on one sequence's tokens, shape (n,), or on rows of several
sequences at once, shape (R, N) with a ``valid`` mask (a decode batch evicting together,
``confkv.evict_rows``). Every reduction is per row and over valid slots only, so a row's result
is bit for bit the one its sequence gets alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_INF = float("inf")


@dataclass
class TokenStats:
    """What a policy may look at when scoring one layer's kept tokens.

    positions (..., n) int64 absolute positions; ema (..., n) float32 EMA of received attention
    mass; cumulative (..., n) float32 summed attention mass (H2O); now = position of the next
    token (an int, or (R, 1) for rows); valid (R, n) bool: the live slots of each row (None: all);
    value_norm (..., n) float32 the L1 norm of each token's value vector, averaged over KV heads
    (given only to a policy whose ``needs_values`` is True).
    """

    positions: torch.Tensor
    ema: torch.Tensor
    cumulative: torch.Tensor
    now: int | torch.Tensor
    generator: torch.Generator | None = None
    valid: torch.Tensor | None = None
    value_norm: torch.Tensor | None = None

    def row_max(self, x: torch.Tensor, where: torch.Tensor | None = None) -> torch.Tensor:
        """(..., 1) max of ``x`` over each row's valid slots (and ``where``, if given)."""
        skip = self._skip(where)
        return (x if skip is None else x.masked_fill(skip, -_INF)).amax(-1, keepdim=True)

    def row_min(self, x: torch.Tensor) -> torch.Tensor:
        skip = self._skip(None)
        return (x if skip is None else x.masked_fill(skip, _INF)).amin(-1, keepdim=True)

    def _skip(self, where: torch.Tensor | None) -> torch.Tensor | None:
        keep = self.valid if where is None else where if self.valid is None else where & self.valid
        return None if keep is None else ~keep

    def live(self) -> torch.Tensor:
        """(..., 1) live slots per row."""
        n = self.positions.shape[-1]
        if self.valid is None:
            return torch.full((*self.positions.shape[:-1], 1), n, device=self.positions.device)
        return self.valid.sum(-1, keepdim=True)

    def recency(self) -> torch.Tensor:
        """(..., n) in [0, 1]: 1 for the newest kept token, 0 for the oldest."""
        pos = self.positions.float()
        lo, hi = self.row_min(pos), self.row_max(pos)
        return (pos - lo) / (hi - lo).clamp_min(1.0)


def protected_mask(positions: torch.Tensor, protect_from: int | torch.Tensor, sinks: int) -> torch.Tensor:
    """(..., n) True for tokens that are never evicted: the recent window (positions >=
    ``protect_from``) and the attention sinks (positions < ``sinks``)."""
    return (positions >= protect_from) | (positions < sinks)


def select_keep(
    scores: torch.Tensor, positions: torch.Tensor, keep: int, protect_from: int, sinks: int
) -> torch.Tensor:
    """Boolean mask (n,) of tokens to keep: the ``keep`` best-scored, never dropping protected ones.

    Protected: positions >= ``protect_from`` (the recent window P) and positions < ``sinks``.
    If more tokens are protected than ``keep``, all protected tokens are kept. Equal scores
    keep the earlier slot (``kept_mask``, the rule a batch shares).
    """
    n = scores.shape[0]
    if n <= keep:
        return torch.ones(n, dtype=torch.bool, device=scores.device)
    device = scores.device
    keeps = torch.tensor([keep], device=device)
    ranked = rank_rows(
        scores[None], positions[None], keeps, torch.tensor([[protect_from]], device=device), sinks
    )
    return kept_mask(ranked)[0]


@dataclass
class Ranked:
    """R rows ranked for eviction (``rank_rows``): ``scores`` (R, N) with protected slots +inf
    and padding -inf, ``keep`` (R,) slots each row keeps, ``live`` (R,) live slots per row (N
    when all are), ``valid`` (R, N) the live slots or None."""

    scores: torch.Tensor
    keep: torch.Tensor
    live: torch.Tensor | int
    valid: torch.Tensor | None


def rank_rows(
    scores: torch.Tensor,
    positions: torch.Tensor,
    keep: torch.Tensor,
    protect_from: torch.Tensor,
    sinks: int,
    valid: torch.Tensor | None = None,
) -> Ranked:
    """``select_keep``'s ranking for R rows at once: scores, positions (R, N), keep (R,),
    protect_from (R, 1), valid (R, N) or None. A row keeps k = max(keep, protected) slots, at
    most its live ones."""
    protected = protected_mask(positions, protect_from, sinks)
    live: torch.Tensor | int = positions.shape[1]
    if valid is not None:
        protected &= valid
        live = valid.sum(1)
    ranked = scores.float().masked_fill(protected, _INF)
    if valid is not None:
        ranked = ranked.masked_fill(~valid, -_INF)
    k = torch.clamp(torch.maximum(keep, protected.sum(1)), max=live)
    return Ranked(ranked, k, live, valid)


def kept_mask(r: Ranked) -> torch.Tensor:
    """(R, N) the slots each row keeps, False past its live ones: its first k in the order
    (score descending, slot ascending), by one stable sort, so ties break the same way in a
    batch as alone."""
    order = r.scores.argsort(dim=1, descending=True, stable=True)
    ranks = torch.arange(r.scores.shape[1], device=r.scores.device)
    mask = torch.empty_like(r.scores, dtype=torch.bool)
    return mask.scatter_(1, order, ranks < r.keep.unsqueeze(1))


def one_out(r: Ranked) -> torch.Tensor | None:
    """The steady state of a batch at its budgets (slack 0: one token in, one out): when
    ``kept_mask`` would drop exactly one slot of every row, that slot per row (R,), found
    without a sort: the last in ``kept_mask``'s order, the lowest score and of equal lowest
    scores the highest slot. None when some row drops another number."""
    if not bool((r.live - r.keep == 1).all()):
        return None
    ranked = r.scores if r.valid is None else r.scores.masked_fill(~r.valid, _INF)  # padding never lowest
    return (ranked.shape[1] - 1) - ranked.flip(1).argmin(1)  # argmin: the first of equal minima
