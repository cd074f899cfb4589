"""Stop sequences, applied by the scheduler to a streamed reply (transport-free, no tensors).

A reply stops *before* the first occurrence of any stop sequence; the stop text itself is never
returned. While streaming, text that might be the start of a stop sequence is held back until
the next delta decides it, so a caller never sees text that is later cut off. The turn recorded
in the session is exactly the text released (see ``Scheduler.chat``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from scheduler_svc.domain import TokenEvent, TurnResult

MAX_STOPS = 4  # as the OpenAI API
MAX_STOP_CHARS = 256


def check_stops(stops: Sequence[str]) -> tuple[str, ...]:
    """Up to MAX_STOPS non-empty strings of at most MAX_STOP_CHARS; ``ValueError`` otherwise."""
    stops = tuple(stops)
    if len(stops) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
    for stop in stops:
        if not isinstance(stop, str) or not 1 <= len(stop) <= MAX_STOP_CHARS:
            raise ValueError(f"a stop sequence must be 1..{MAX_STOP_CHARS} characters")
    return stops


def cut_at_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index of the earliest stop sequence in ``text`` (the reply ends there), or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


class StopMatcher:
    """Feeds text deltas; ``push`` returns the part safe to release and whether a stop matched.

    Invariant: ``released`` never contains a stop sequence, and no stop sequence can start inside
    it (every suffix of the text that is a prefix of a stop is held back)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.released = ""
        self.held = ""
        self.matched = False

    def push(self, delta: str) -> str:
        if self.matched:
            return ""
        text = self.held + delta
        cut = cut_at_stop(text, self.stops)
        if cut is not None:
            self.matched, self.held = True, ""
            return self._release(text[:cut])
        keep = self._partial_suffix(text)
        self.held = text[len(text) - keep :] if keep else ""
        return self._release(text[: len(text) - keep])

    def _release(self, text: str) -> str:
        self.released += text
        return text

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop sequence."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest


def cut_result(result: TurnResult, matcher: StopMatcher, stopped_at: TokenEvent | None) -> TurnResult:
    """The worker's result as the caller saw it: cut at the stop sequence, counted up to the token
    that completed it (``context_tokens`` as if the turn had ended there)."""
    if not matcher.stops:
        return result
    if stopped_at is None:  # no stop while streaming; the final text may still hold one
        cut = cut_at_stop(result.reply, matcher.stops)
        if cut is None:
            return result
        return replace(result, reply=result.reply[:cut], finish_reason="stop")
    shown = stopped_at.index + 1
    extra = max(result.generated_tokens - shown, 0)
    return replace(
        result,
        reply=matcher.released,
        finish_reason="stop",
        generated_tokens=shown,
        context_tokens=max(result.context_tokens - extra, 0),
        kv_bytes=stopped_at.session_bytes,
    )
