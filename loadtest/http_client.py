"""A load-test client of the OpenAI-compatible HTTP API (the official ``openai`` client, streamed
with usage): each call sends the whole conversation, as an agent framework does; the scheduler
maps it onto one Conf-KV session. Works under threads and (gevent-patched) greenlets."""

from __future__ import annotations

import os
from dataclasses import dataclass

from loadtest.client import TOKEN_ENV
from loadtest.metrics import TurnMetrics, TurnTimer


@dataclass(frozen=True)
class HttpTurnReply:
    text: str
    metrics: TurnMetrics
    finish_reason: str
    session_id: str
    cached_tokens: int  # prompt tokens the session's cache already held (not re-read)
    kv_bytes: int


class OpenAIChatClient:
    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        import openai

        key = os.environ.get(TOKEN_ENV) or "unused"
        self.client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=timeout_s)
        self.in_flight: set = set()  # open streams

    def default_model(self) -> str:
        models = self.client.models.list().data
        if not models:
            raise RuntimeError("the server lists no model")
        return models[0].id

    def chat(self, messages: list[dict], model: str, policy: str, max_new_tokens: int) -> HttpTurnReply:
        """Stream one completion; raises ``openai.OpenAIError`` on failure (the caller counts it)."""
        timer = TurnTimer()
        stream = self.client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_new_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"kv_policy": policy} if policy else None,
        )  # fmt: skip
        self.in_flight.add(stream)
        parts, finish, usage, ext = [], "", None, {}
        try:
            for chunk in stream:
                if chunk.choices:
                    choice = chunk.choices[0]
                    if choice.delta.content:
                        timer.token()
                        parts.append(choice.delta.content)
                    finish = choice.finish_reason or finish
                ext = (chunk.model_extra or {}).get("confkv") or ext
                usage = chunk.usage or usage
        finally:  # an error, or the load test stopping this user: the server cancels the turn
            stream.close()
            self.in_flight.discard(stream)
        cached = usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else 0
        return HttpTurnReply(
            "".join(parts),
            timer.finish(),
            finish,
            ext.get("session_id", ""),
            cached or 0,
            ext.get("kv_bytes", 0),
        )

    def close(self) -> None:
        for stream in list(self.in_flight):
            stream.close()
        self.in_flight.clear()
        self.client.close()
