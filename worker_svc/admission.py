"""Input validation for the engine (pure functions, no locks), against the limits both services
share (``confkv.limits``).

A turn reserves its worst case: the policy's peak bound (``peak_bytes_bound``), capped by a
full cache of the turn's whole context (prompt + max new tokens), since no policy stores more
tokens than it has seen nor more bytes per token than the model dtype. ``full`` is bounded by
that context alone.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Sequence

from confkv import limits
from confkv.memory import KVGeometry
from confkv.policies import CachePolicy, parse_policy
from worker_svc.codec import ChatCodec
from worker_svc.types import ChatMessage, EngineConfig, InvalidRequest, PoolExhausted, TurnRequest

log = logging.getLogger("confkv.worker")


def check_session_id(session_id: str) -> None:
    try:
        limits.check_session_id(session_id)
    except ValueError as err:
        raise InvalidRequest(str(err)) from None


def check_sampling(request: TurnRequest) -> None:
    try:
        limits.check_temperature(request.temperature)
        limits.check_top_p(request.top_p)
        limits.check_request_id(request.request_id)
        if not 0 <= request.seed <= limits.MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**64 - 1], got {request.seed}")
    except ValueError as err:
        raise InvalidRequest(str(err)) from None


def check_transcript(messages: Sequence[ChatMessage], config: EngineConfig) -> None:
    """A conversation longer (in characters) than the context could ever hold is refused before
    it is tokenized."""
    total, cap = (
        sum(len(m.content) for m in messages),
        limits.transcript_char_limit(config.max_context_tokens),
    )
    if total > cap:
        raise PoolExhausted(
            f"the conversation has {total} characters; at most {cap} can fit a "
            f"{config.max_context_tokens}-token "
            "context: start a new session"
        )


@contextlib.contextmanager
def template_errors() -> Iterator[None]:
    """A chat template that rejects the conversation is the caller's error: InvalidRequest."""
    try:
        yield
    except InvalidRequest:
        raise
    except Exception as err:  # jinja TemplateError and friends: the input, not the worker
        log.info("chat template refused the conversation: %s", err)
        raise InvalidRequest(
            f"the model's chat template rejects this conversation: {str(err)[:200]}"
        ) from None


def encode(codec: ChatCodec, messages: Sequence[ChatMessage]) -> list[int]:
    """Token ids of the whole conversation (sessions encode incrementally: ``worker_svc.prompt``)."""
    with template_errors():
        return codec.encode_chat(messages)


def parse(spec: str, geometry: KVGeometry) -> CachePolicy:
    """Policy spec -> policy resolved for this model; InvalidRequest with the parser's reason."""
    try:
        return parse_policy(spec).resolve(geometry)
    except ValueError as err:
        raise InvalidRequest(f"invalid policy spec {spec!r}: {err}") from None


def check_messages(
    messages: Iterable[ChatMessage], config: EngineConfig, allow_empty: bool = False
) -> tuple[ChatMessage, ...]:
    out = tuple(messages)
    if not out and not allow_empty:
        raise InvalidRequest("at least one message is needed")
    try:
        limits.check_message_count(len(out))
        for i, m in enumerate(out):
            limits.check_role(m.role, f"message {i}")
            limits.check_text(m.content, f"message {i}")
    except ValueError as err:
        raise InvalidRequest(str(err)) from None
    return out


def check_max_new_tokens(value: int, config: EngineConfig) -> int:
    """0 -> the default; negative or above the limit -> InvalidRequest."""
    if value < 0:
        raise InvalidRequest(f"max_new_tokens must be in [0, {config.max_new_tokens_limit}], got {value}")
    if value > config.max_new_tokens_limit:
        raise InvalidRequest(
            f"max_new_tokens {value} exceeds this worker's limit {config.max_new_tokens_limit}"
        )
    return value or config.default_max_new_tokens


def policy_bound(policy: CachePolicy, geometry: KVGeometry) -> int | None:
    """The policy's own peak KV bytes, or None when it does not bound them (``full``)."""
    return policy.peak_bytes_bound(geometry) if policy.evicts else None
