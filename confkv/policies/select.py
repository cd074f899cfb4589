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
    token (an int, or (R, 1) for rows); valid (R, n) bool: the live slots of each row (None: all).
    """

    positions: torch.Tensor
    ema: torch.Tensor
    cumulative: torch.Tensor
    now: int | torch.Tensor
    generator: torch.Generator | None = None
    valid: torch.Tensor | None = None

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
    keep the earlier slot (``select_rows``, the rule a batch shares).
    """
    n = scores.shape[0]
    if n <= keep:
        return torch.ones(n, dtype=torch.bool, device=scores.device)
    device = scores.device
    rows = select_rows(
        scores[None],
        positions[None],
        torch.tensor([keep], device=device),
        torch.tensor([[protect_from]], device=device),
        sinks,
    )
    return rows[0]


def select_rows(
    scores: torch.Tensor,
    positions: torch.Tensor,
    keep: torch.Tensor,
    protect_from: torch.Tensor,
    sinks: int,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """``select_keep`` for R rows at once: scores, positions (R, N), keep (R,), protect_from
    (R, 1), valid (R, N) or None -> mask (R, N), False past each row's live slots. The kept
    tokens of a row are its first k in the order (score descending, slot ascending), with k =
    max(keep, protected), at most the live slots: one stable sort, so ties break the same way
    in a batch as alone."""
    ranked, k, _ = _ranked(scores, positions, keep, protect_from, sinks, valid)
    order = ranked.argsort(dim=1, descending=True, stable=True)
    ranks = torch.arange(positions.shape[1], device=positions.device)
    mask = torch.empty_like(ranked, dtype=torch.bool)
    return mask.scatter_(1, order, ranks < k.unsqueeze(1))


def one_out_rows(
    scores: torch.Tensor,
    positions: torch.Tensor,
    keep: torch.Tensor,
    protect_from: torch.Tensor,
    sinks: int,
    valid: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The steady state of a batch at its budgets (slack 0: one token in, one out): when
    ``select_rows`` would drop exactly one slot of every row, that slot per row (R,), found
    without a sort: the last in ``select_rows``' order, the lowest score and of equal lowest
    scores the highest slot. None when some row drops another number."""
    ranked, k, live = _ranked(scores, positions, keep, protect_from, sinks, valid)
    if not bool((live - k == 1).all()):
        return None
    if valid is not None:  # padding must never be the lowest
        ranked = ranked.masked_fill(~valid, _INF)
    return (ranked.shape[1] - 1) - ranked.flip(1).argmin(1)  # argmin: the first of equal minima


def _ranked(scores, positions, keep, protect_from, sinks, valid):
    """-> (ranked (R, N): scores with protected slots +inf and padding -inf, k (R,) slots kept,
    live slots (R,) or N)."""
    protected = protected_mask(positions, protect_from, sinks)
    if valid is not None:
        protected &= valid
    ranked = scores.float().masked_fill(protected, _INF)
    live = positions.shape[1] if valid is None else valid.sum(1)
    if valid is not None:
        ranked = ranked.masked_fill(~valid, -_INF)
    k = torch.clamp(torch.maximum(keep, protected.sum(1)), max=live)
    return ranked, k, live
