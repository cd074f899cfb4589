"""Engine statistics as dataclasses, consumed by loggers and the Prometheus exporter."""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class StepStats:
    batch_size: int  # sequences advanced by the step's batched forward
    tokens: int  # tokens produced (sampled) in this step
    seconds: float
    used_bytes: int
    capacity_bytes: int


class ThroughputMeter:
    """Tokens per second over a sliding window (seconds)."""

    def __init__(self, window: float = 10.0):
        self.window = window
        self.events: collections.deque[tuple[float, int]] = collections.deque()
        self.lock = threading.Lock()

    def add(self, tokens: int, now: float | None = None) -> None:
        if tokens <= 0:
            return
        now = time.monotonic() if now is None else now
        with self.lock:
            self.events.append((now, tokens))
            self._trim(now)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self.lock:
            self._trim(now)
            if not self.events:
                return 0.0
            span = max(now - self.events[0][0], 1e-3)
            return sum(n for _, n in self.events) / max(span, min(self.window, 1.0))

    def _trim(self, now: float) -> None:
        while self.events and now - self.events[0][0] > self.window:
            self.events.popleft()
