"""Chat codecs: messages <-> token ids for the engine (the tokenizer stays out of the engine loop).

``HFChatCodec`` wraps a HuggingFace tokenizer and its chat template; ``ByteChatCodec`` is a
tokenizer-free byte codec for tiny test models (vocab 256 bytes + 4 specials).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from worker_svc.types import ChatMessage


class ChatCodec(Protocol):
    eos_ids: frozenset[int]

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        """The conversation, ready for the assistant's reply (generation prompt added)."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...


class HFChatCodec:
    def __init__(self, tokenizer, extra_eos: Sequence[int] = ()):
        self.tokenizer = tokenizer
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.eos_ids = frozenset(eos | set(extra_eos))

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        dicts = [{"role": m.role, "content": m.content} for m in messages]
        if self.tokenizer.chat_template is None:
            text = "".join(f"{m.role}: {m.content}\n" for m in messages) + "assistant:"
            return list(self.tokenizer(text).input_ids)
        out = self.tokenizer.apply_chat_template(dicts, add_generation_prompt=True, return_dict=True)
        return list(out["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


class ByteChatCodec:
    """``<role-id> bytes... <end>`` per message, then ``<assistant>``; ids 256.. are specials."""

    END, USER, ASSISTANT, SYSTEM = 256, 257, 258, 259
    vocab_size = 260

    def __init__(self):
        self.eos_ids = frozenset({self.END})

    def _role(self, role: str) -> int:
        return {"user": self.USER, "assistant": self.ASSISTANT}.get(role, self.SYSTEM)

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        ids: list[int] = []
        for m in messages:
            ids += [self._role(m.role), *m.content.encode("utf-8"), self.END]
        return ids + [self.ASSISTANT]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
