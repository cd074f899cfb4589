"""Incremental prompt encoding: a session keeps the token ids of its conversation rendered so far,
so that a turn tokenizes only the new text (a 120-turn transcript of 3.6 MB is ~700k tokens; the
new turn is a few thousand).

Per turn: render the whole conversation with the chat template (cheap string work), check that it
still starts with the cached rendering (a blake2b digest of it), and encode only the text after
it. The cache is cut at the codec's last cut point (just after a special token), where encoding in
pieces equals encoding whole. A template that rewrites earlier text (or a cancelled turn, whose
message is not in the next rendering) fails the check: that turn encodes whole, counted as
``full`` in ``PromptStats``.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from worker_svc.admission import template_errors
from worker_svc.codec import ChatCodec
from worker_svc.types import ChatMessage


class EncodeMode(StrEnum):
    INCREMENTAL = "incremental"  # the cached prefix was reused: only the new text was encoded
    FULL = "full"  # the whole conversation was encoded (first turn, or the prefix did not match)


@dataclass(frozen=True)
class EncodedPrefix:
    """A session's rendered conversation up to a cut point, and its ids. Replaced whole, never
    mutated: two threads that encode for one session at once each see a consistent pair."""

    chars: int  # length of the rendered prefix (characters)
    digest: bytes  # blake2b of its UTF-8 text
    ids: array  # its token ids ("I": 4 bytes a token)


class PromptStats:
    """One worker's encode counters (thread-safe; read by the metrics collector at scrape time)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens = 0
        self._encodes = dict.fromkeys(EncodeMode, 0)

    def record(self, mode: EncodeMode, tokens: int) -> None:
        with self._lock:
            self._tokens += tokens
            self._encodes[mode] += 1

    def snapshot(self) -> tuple[int, dict[EncodeMode, int]]:
        """(tokens encoded, encodes per mode) since the worker started."""
        with self._lock:
            return self._tokens, dict(self._encodes)


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def _starts_with(text: str, prefix: EncodedPrefix) -> bool:
    return 0 < prefix.chars <= len(text) and _digest(text[: prefix.chars]) == prefix.digest


class PromptEncoder:
    """Encodes conversations for one codec, reusing a session's ``EncodedPrefix``."""

    def __init__(self, codec: ChatCodec) -> None:
        self.codec = codec
        self.stats = PromptStats()

    def encode(
        self, messages: Sequence[ChatMessage], cached: EncodedPrefix | None
    ) -> tuple[list[int], EncodedPrefix | None]:
        """Ids of the conversation (generation prompt included) and the prefix to keep for the
        next turn; raises InvalidRequest when the chat template rejects the conversation."""
        with template_errors():
            text = self.codec.render_chat(messages)
            if text is None:  # no template to render: the codec encodes whole
                ids = self.codec.encode_chat(messages)
                self.stats.record(EncodeMode.FULL, len(ids))
                return ids, None
            base = cached if cached is not None and _starts_with(text, cached) else None
            start = base.chars if base is not None else 0
            cut = self.codec.last_cut(text, start)
            middle = self.codec.encode_text(text[start:cut])
            tail = self.codec.encode_text(text[cut:])
        head = array("I", base.ids if base is not None else ())
        head.extend(middle)
        mode = EncodeMode.INCREMENTAL if base is not None else EncodeMode.FULL
        self.stats.record(mode, len(middle) + len(tail))
        prefix = EncodedPrefix(cut, _digest(text[:cut]), head) if cut > 0 else None
        return head.tolist() + tail, prefix
