"""Input validation and KV-pool arithmetic for the engine (pure functions, no locks).

A turn reserves its worst case: the policy's peak bound (``peak_bytes_bound``), capped by a
full cache of the turn's whole context (prompt + max new tokens), since no policy stores more
tokens than it has seen nor more bytes per token than the model dtype. ``full`` is bounded by
that context alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from confkv.memory import KVGeometry
from confkv.policies import CachePolicy, parse_policy
from worker_svc.session import Session
from worker_svc.types import ChatMessage, EngineConfig, InvalidRequest, SessionState

ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_SESSION_ID = 128


def check_session_id(session_id: str) -> None:
    if not session_id or len(session_id) > MAX_SESSION_ID or not session_id.isprintable():
        raise InvalidRequest(f"session id must be 1..{MAX_SESSION_ID} printable characters")


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
    for i, m in enumerate(out):
        if m.role not in ROLES:
            raise InvalidRequest(
                f"message {i}: unknown role {m.role!r}; use one of {', '.join(sorted(ROLES))}"
            )
        if not m.content.strip():
            raise InvalidRequest(f"message {i}: empty content")
        if len(m.content) > config.max_message_chars:
            raise InvalidRequest(
                f"message {i}: {len(m.content)} characters exceeds the limit of {config.max_message_chars}"
            )
    return out


def check_max_new_tokens(value: int, config: EngineConfig) -> int:
    """0 -> the default; negative or above the limit -> InvalidRequest."""
    if value < 0:
        raise InvalidRequest(f"max_new_tokens must be >= 0, got {value}")
    if value > config.max_new_tokens_limit:
        raise InvalidRequest(
            f"max_new_tokens {value} exceeds this worker's limit {config.max_new_tokens_limit}"
        )
    return value or config.default_max_new_tokens


def policy_bound(policy: CachePolicy, geometry: KVGeometry) -> int | None:
    """The policy's own peak KV bytes, or None when it does not bound them (``full``)."""
    return policy.peak_bytes_bound(geometry) if policy.evicts else None


def release_idle(sessions: Mapping[str, Session], keep: Session, needed: int) -> int:
    """Free idle sessions' KV (least recently used first) until ``needed`` reserved bytes are
    released; their transcripts stay, their next turn rebuilds the cache. Returns bytes freed."""
    idle = [
        s for s in sessions.values()
        if s is not keep and s.state is SessionState.IDLE and s.turn is None and s.reserved_bytes > 0
    ]  # fmt: skip
    freed = 0
    for session in sorted(idle, key=lambda s: s.last_used):
        if freed >= needed:
            break
        freed += session.reserved_bytes
        session.release_kv()
    return freed
