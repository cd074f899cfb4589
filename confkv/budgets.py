"""Token budgets: fixed, confidence-gated, replayed, and the pyramidal per-layer split."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FixedBudget:
    """The same number of tokens at every step (window, sinks, h2o)."""

    n: int

    def __call__(self, confidence: float | None) -> int:
        return self.n

    @property
    def peak(self) -> int:
        return self.n


@dataclass(frozen=True)
class GatedBudget:
    """Unsure (c < tau) -> keep ``n_high`` tokens; sure -> prune to ``n_low``.

    Before the first confidence is known (prompt processing) the budget is ``n_high``.
    """

    n_high: int
    n_low: int
    tau: float

    def __post_init__(self) -> None:
        if not 0 < self.n_low <= self.n_high:
            raise ValueError(f"need 0 < n_low <= n_high, got n_low={self.n_low}, n_high={self.n_high}")
        if not 0.0 <= self.tau <= 1.0:
            raise ValueError(f"tau must be in [0, 1], got {self.tau}")

    def __call__(self, confidence: float | None) -> int:
        if confidence is None:
            return self.n_high
        return self.n_high if confidence < self.tau else self.n_low

    @property
    def peak(self) -> int:
        return self.n_high


def pyramid_split(total: int, n_layers: int, slope: float, minimum: int = 1) -> list[int]:
    """Split ``total * n_layers`` tokens over layers, deeper layers smaller, same sum.

    Layer l gets about total * (1 + slope * (1 - 2 l / (L - 1))): the first layer (1 + slope)
    times the flat budget, the last (1 - slope) times. Every layer keeps at least ``minimum``.
    """
    if not 0.0 <= slope < 1.0:
        raise ValueError(f"pyramid slope must be in [0, 1), got {slope}")
    if n_layers == 1 or slope == 0.0:
        return [total] * n_layers
    grand = total * n_layers
    raw = [total * (1 + slope * (1 - 2 * layer / (n_layers - 1))) for layer in range(n_layers)]
    sizes = [max(minimum, int(r)) for r in raw]
    # Hand out (or take back) the rounding remainder, largest fractional parts first, so the
    # per-layer budgets sum exactly to the flat total.
    order = sorted(range(n_layers), key=lambda i: raw[i] - int(raw[i]), reverse=True)
    diff = grand - sum(sizes)
    i = 0
    while diff != 0:
        layer = order[i % n_layers]
        if diff > 0:
            sizes[layer] += 1
            diff -= 1
        elif sizes[layer] > minimum:
            sizes[layer] -= 1
            diff += 1
        i += 1
        if i > 4 * n_layers * (abs(diff) + 1) and diff < 0:
            raise ValueError(f"cannot split {grand} tokens over {n_layers} layers with minimum {minimum}")
    return sizes
