"""Per-turn streaming metrics and their summary (pure: used by the locustfile and capacity.py).

Units: seconds inside, milliseconds in summaries (``*_ms``), tokens per second (``tok_s``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


@dataclass
class TurnTimer:
    """Timestamps of one streamed reply: call ``token()`` per streamed token, then ``finish()``."""

    start: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)
    end: float | None = None
    queued: bool = False

    def token(self) -> None:
        self.token_times.append(time.perf_counter())

    def finish(self) -> TurnMetrics:
        self.end = time.perf_counter()
        return TurnMetrics.from_times(self.start, self.token_times, self.end, self.queued)


@dataclass(frozen=True)
class TurnMetrics:
    seconds: float
    tokens: int
    ttft_s: float | None  # None when no token came back
    itl_s: tuple[float, ...]  # gaps between consecutive tokens
    queued: bool = False

    @classmethod
    def from_times(
        cls, start: float, token_times: list[float], end: float, queued: bool = False
    ) -> TurnMetrics:
        gaps = tuple(b - a for a, b in zip(token_times, token_times[1:], strict=False))
        ttft = token_times[0] - start if token_times else None
        return cls(end - start, len(token_times), ttft, gaps, queued)

    @property
    def tokens_per_second(self) -> float:
        """Decode rate of this stream after its first token."""
        span = sum(self.itl_s)
        return (self.tokens - 1) / span if self.tokens > 1 and span > 0 else 0.0


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


def summarize(turns: list[TurnMetrics], failures: dict[str, int], wall_s: float) -> dict:
    """Aggregate of a run: TTFT / inter-token latency percentiles, throughput, failures per RPC."""
    ttfts = [t.ttft_s for t in turns if t.ttft_s is not None]
    gaps = [g for t in turns for g in t.itl_s]
    tokens = sum(t.tokens for t in turns)
    return {
        "turns": len(turns),
        "tokens": tokens,
        "wall_s": round(wall_s, 3),
        "throughput_tok_s": round(tokens / wall_s, 3) if wall_s > 0 else 0.0,
        "per_stream_tok_s_p50": percentile([t.tokens_per_second for t in turns if t.tokens > 1], 50),
        "ttft_ms_p50": _ms(percentile(ttfts, 50)),
        "ttft_ms_p95": _ms(percentile(ttfts, 95)),
        "itl_ms_p50": _ms(percentile(gaps, 50)),
        "itl_ms_p95": _ms(percentile(gaps, 95)),
        "turn_s_p50": percentile([t.seconds for t in turns], 50),
        "queued_turns": sum(t.queued for t in turns),
        "failures": dict(failures),
        "failed": sum(failures.values()),
    }
