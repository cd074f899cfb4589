"""Response bodies of the chat-completions API: the completion, stream chunks, SSE framing,
``usage`` and the ``confkv`` extension object (session id and its KV bytes).

Token counts come from the worker's report of the turn: ``prompt_tokens`` is the whole prompt
(the conversation through the chat template), ``prompt_tokens_details.cached_tokens`` the part
of it already in the session's Conf-KV cache (not re-read this turn).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass

from scheduler_svc.domain import TurnDone, TurnResult

FINISH_REASONS = {"eos": "stop", "stop": "stop", "max_tokens": "length", "context": "length"}


def usage(result: TurnResult) -> dict:
    """The worker reports tokens fed this turn (``prompt_tokens``: the uncached suffix) and the
    session's context after it; the context ends with every generated token but the last (the
    last one sampled is never fed back), so the whole prompt is what remains of it."""
    completion = result.generated_tokens
    prompt = max(result.context_tokens - max(completion - 1, 0), result.prompt_tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": prompt - result.prompt_tokens},
    }


@dataclass(frozen=True)
class Completion:
    """What every body of one call shares."""

    completion_id: str
    created: int
    model: str
    session_id: str
    new_session: bool
    policy: str

    @classmethod
    def new(cls, model: str, session_id: str, new_session: bool, policy: str) -> Completion:
        return cls(
            f"chatcmpl-{secrets.token_hex(12)}", int(time.time()), model, session_id, new_session, policy
        )

    def confkv(self, done: TurnDone) -> dict:
        """Extension object: the session and its KV cache after the turn (bytes are exact stored
        bytes: ``kv_bytes`` hot, what attention reads; ``reserved_bytes`` the worst case held)."""
        return {
            "session_id": self.session_id,
            "new_session": self.new_session,
            "policy": self.policy,
            "turn": done.turn,
            "worker": done.worker,
            "kv_bytes": done.result.kv_bytes,
            "peak_kv_bytes": done.result.peak_bytes,
            "reserved_bytes": done.footprint_bytes,
        }

    def body(self, done: TurnDone) -> dict:
        result = done.result
        return {
            "id": self.completion_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": result.reply},
                    "finish_reason": FINISH_REASONS.get(result.finish_reason, "stop"),
                    "logprobs": None,
                }
            ],
            "usage": usage(result),
            "confkv": self.confkv(done),
        }

    def chunk(self, delta: dict, finish_reason: str | None = None, **extra) -> dict:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            **extra,
        }

    def last_chunks(self, done: TurnDone, include_usage: bool) -> list[dict]:
        """The finishing chunk, then (``stream_options.include_usage``) the usage chunk with no
        choices, as OpenAI sends it; without that option usage rides on the finishing chunk."""
        finish = FINISH_REASONS.get(done.result.finish_reason, "stop")
        counts = usage(done.result)
        extra = {"confkv": self.confkv(done)}
        if not include_usage:
            extra["usage"] = counts
        chunks = [self.chunk({}, finish, **extra)]
        if include_usage:
            chunks.append({**self.chunk({}), "choices": [], "usage": counts})
        return chunks


def sse(data: dict | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


DONE = sse("[DONE]")
