"""Output handling, apart from stepping: detokenize a turn's tokens into text deltas that never
split a character, and the reply text that is committed (without a cut-off last character)."""

from __future__ import annotations

from collections.abc import Sequence

from worker_svc.codec import ChatCodec

REPLACEMENT = "\ufffd"


class Detokenizer:
    """Incremental text of one reply. ``push`` returns the new text delta ('' while the last
    token ends mid-character); ``final()`` is the committed reply."""

    def __init__(self, codec: ChatCodec) -> None:
        self.codec = codec
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.codec.decode(self.ids)
        if text.endswith(REPLACEMENT) or not text.startswith(self.emitted):
            return ""  # an incomplete character (or a re-segmentation): wait for the next token
        delta, self.emitted = text[len(self.emitted) :], text
        return delta

    def final(self, ids: Sequence[int] | None = None) -> str:
        """The reply as committed: a reply cut mid-character (max tokens, context) drops the
        incomplete bytes instead of storing U+FFFD."""
        text = self.codec.decode(list(self.ids if ids is None else ids))
        return text.rstrip(REPLACEMENT) if text.endswith(REPLACEMENT) else text
