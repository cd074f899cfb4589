"""Chat codecs: messages <-> token ids for the engine (the tokenizer stays out of the engine loop).

``HFChatCodec`` wraps a HuggingFace tokenizer and its chat template; ``ByteChatCodec`` is a
tokenizer-free byte codec for tiny test models (vocab 256 bytes + 4 specials).

Besides ``encode_chat`` (the whole conversation at once), a codec splits it into two steps so that
a session can encode only what is new (``worker_svc.prompt``): ``render_chat`` gives the template's
text and ``encode_text`` its ids, with ``encode_text(a + b) == encode_text(a) + encode_text(b)``
whenever ``len(a)`` is a cut point (``last_cut``): just after a special token, where the tokenizer
splits before any merging. ``render_chat`` returns None when the codec cannot encode in pieces.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Protocol

from worker_svc.types import ChatMessage


class ChatCodec(Protocol):
    eos_ids: frozenset[int]

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        """The conversation, ready for the assistant's reply (generation prompt added)."""
        ...

    def render_chat(self, messages: Sequence[ChatMessage]) -> str | None:
        """The text ``encode_chat`` tokenizes (None: no piecewise encoding for this codec)."""
        ...

    def encode_text(self, text: str) -> list[int]:
        """Ids of a piece of rendered text (special-token text becomes its id; nothing added)."""
        ...

    def last_cut(self, text: str, start: int = 0) -> int:
        """The last cut point of ``text`` at or after ``start`` (``start`` when there is none)."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...


class HFChatCodec:
    def __init__(self, tokenizer, extra_eos: Sequence[int] = ()):
        self.tokenizer = tokenizer
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.eos_ids = frozenset(eos | set(extra_eos))
        # special tokens split the text before the pre-tokenizer runs: the only safe cut points
        self._specials: tuple[str, ...] = tuple(set(getattr(tokenizer, "all_special_tokens", ())))
        if not self._pieces_match_whole():
            self._specials = ()  # no cut points: every encode is a whole one

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        text = self.render_chat(messages)
        if text is None:
            legacy = "".join(f"{m.role}: {m.content}\n" for m in messages) + "assistant:"
            return list(self.tokenizer(legacy).input_ids)
        return self.encode_text(text)

    def render_chat(self, messages: Sequence[ChatMessage]) -> str | None:
        if self.tokenizer.chat_template is None:
            return None
        dicts = [{"role": m.role, "content": m.content} for m in messages]
        return str(self.tokenizer.apply_chat_template(dicts, add_generation_prompt=True, tokenize=False))

    def encode_text(self, text: str) -> list[int]:
        # as apply_chat_template tokenizes: the template writes BOS and friends itself
        return list(self.tokenizer(text, add_special_tokens=False).input_ids) if text else []

    def last_cut(self, text: str, start: int = 0) -> int:
        ends = (text.rfind(s, start) for s in self._specials)
        return max((i + len(s) for i, s in zip(ends, self._specials, strict=True) if i >= 0), default=start)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _pieces_match_whole(self) -> bool:
        """Probe once: a sample conversation encoded in pieces cut after every special token must
        give the whole encoding (a tokenizer that strips spaces next to specials, or prefixes a
        space to each piece, fails and then always encodes whole)."""
        sample = [ChatMessage("user", " Hi\n\n  there "), ChatMessage("assistant", "\nHello! "),
                  ChatMessage("user", "ok")]  # fmt: skip
        try:
            text = self.render_chat(sample)
        except Exception:  # a template that refuses the sample: no evidence, so no pieces
            return False
        if text is None or not self._specials:
            return False
        pattern = re.compile("|".join(re.escape(s) for s in sorted(self._specials, key=len, reverse=True)))
        cuts = [0, *(m.end() for m in pattern.finditer(text)), len(text)]
        pieces = [i for a, b in itertools.pairwise(cuts) for i in self.encode_text(text[a:b])]
        return pieces == self.encode_text(text)


_BYTE_SPECIALS = re.compile("([\ue000-\ue003])")


class ByteChatCodec:
    """``<role-id> bytes... <end>`` per message, then ``<assistant>``; ids 256.. are specials.

    Rendered, the specials are the private-use characters U+E000.. (like a tokenizer's special
    token text, they are specials wherever they appear); every character boundary is a cut point.
    """

    END, USER, ASSISTANT, SYSTEM = 256, 257, 258, 259
    vocab_size = 260
    _BASE = 0xE000 - 256  # id 256 + k <-> chr(0xE000 + k)

    def __init__(self):
        self.eos_ids = frozenset({self.END})

    def _role(self, role: str) -> int:
        return {"user": self.USER, "assistant": self.ASSISTANT}.get(role, self.SYSTEM)

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        return self.encode_text(self.render_chat(messages))

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        special = lambda i: chr(self._BASE + i)
        body = "".join(f"{special(self._role(m.role))}{m.content}{special(self.END)}" for m in messages)
        return body + special(self.ASSISTANT)

    def encode_text(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, piece in enumerate(_BYTE_SPECIALS.split(text)):  # odd pieces: one special each
            ids += [ord(piece) - self._BASE] if i % 2 else piece.encode("utf-8")
        return ids

    def last_cut(self, text: str, start: int = 0) -> int:
        return max(start, len(text))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
