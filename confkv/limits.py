"""The one contract both services validate against: limits, roles and typed sampling.

The scheduler and the worker import this module (they never import each other), so a request the
scheduler accepts is one every worker accepts: same roles, same message and session-id limits,
same sampling ranges. Errors are ``ValueError`` with a one-line reason; each service maps them to
its own INVALID_ARGUMENT error type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ROLES = ("system", "user", "assistant", "tool")
TURN_ROLES = ("user", "tool")  # a turn starts with one of these
MAX_SESSION_ID_CHARS = 128
MAX_REQUEST_ID_CHARS = 128
MAX_MESSAGE_CHARS = 32_000
MAX_MESSAGES = 1_000  # messages in one request (a create or an open)
# A whole transcript is capped in characters against the context limit: no tokenizer maps more
# than this many characters to one token in practice, so a longer transcript can never fit and
# is refused before anyone tokenizes it (tokenizing megabytes under a lock stalls every session).
CHARS_PER_TOKEN_CAP = 8
MAX_TRANSCRIPT_CHARS = 2_000_000
MAX_NEW_TOKENS_LIMIT = 4096
MIN_TEMPERATURE = 1e-2  # below this (but above 0) logits / T overflows: use 0 (greedy) instead
MAX_TEMPERATURE = 10.0
MAX_SEED = 2**64 - 1


def check_session_id(session_id: object) -> str:
    if not isinstance(session_id, str) or not 1 <= len(session_id) <= MAX_SESSION_ID_CHARS:
        raise ValueError(f"session id must be 1..{MAX_SESSION_ID_CHARS} printable characters")
    if not session_id.isprintable() or not session_id.isascii():
        raise ValueError(f"session id must be 1..{MAX_SESSION_ID_CHARS} printable characters")
    return session_id


def check_request_id(request_id: object) -> str:
    """'' (none) or up to MAX_REQUEST_ID_CHARS printable ASCII characters."""
    if not isinstance(request_id, str) or len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request id must be at most {MAX_REQUEST_ID_CHARS} printable characters")
    if request_id and not (request_id.isprintable() and request_id.isascii()):
        raise ValueError(f"request id must be at most {MAX_REQUEST_ID_CHARS} printable characters")
    return request_id


def check_text(content: object, what: str = "message") -> str:
    """Non-blank, at most MAX_MESSAGE_CHARS, encodable as UTF-8 (no lone surrogates)."""
    if not isinstance(content, str) or not content.strip():
        raise ValueError(f"{what}: empty content")
    if len(content) > MAX_MESSAGE_CHARS:
        raise ValueError(f"{what}: {len(content)} characters exceeds the limit of {MAX_MESSAGE_CHARS}")
    try:
        content.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what}: not valid Unicode text") from None
    return content


def check_role(role: object, what: str = "message") -> str:
    if role not in ROLES:
        raise ValueError(f"{what}: unknown role {role!r}; use one of {', '.join(ROLES)}")
    return str(role)


def check_message_count(count: int) -> None:
    if count > MAX_MESSAGES:
        raise ValueError(f"at most {MAX_MESSAGES} messages per request, got {count}")


def transcript_char_limit(max_context_tokens: int) -> int:
    """Characters a whole transcript may hold for a model with this context."""
    return min(MAX_TRANSCRIPT_CHARS, max_context_tokens * CHARS_PER_TOKEN_CAP)


def check_max_new_tokens(value: int, limit: int = MAX_NEW_TOKENS_LIMIT) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
        raise ValueError(f"max_new_tokens must be in [0, {limit}], got {value}")
    return value


def check_top_p(value: float) -> float:
    """Nucleus sampling mass: a finite value in (0, 1]; 1 keeps the whole distribution."""
    value = float(value)
    if not math.isfinite(value) or not 0.0 < value <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {value!r}")
    return value


def check_temperature(value: float) -> float:
    """0 (greedy) or a finite value in [MIN_TEMPERATURE, MAX_TEMPERATURE]."""
    value = float(value)
    if value == 0.0:
        return 0.0
    if not math.isfinite(value) or not MIN_TEMPERATURE <= value <= MAX_TEMPERATURE:
        raise ValueError(
            f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {value!r}"
        )
    return value


@dataclass(frozen=True)
class Sampling:
    """How one turn samples. ``max_new_tokens`` 0 = the server's default; temperature 0 = greedy."""

    max_new_tokens: int = 0
    temperature: float = 0.0
    seed: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        check_max_new_tokens(self.max_new_tokens)
        check_temperature(self.temperature)
        check_top_p(self.top_p)
        if not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**64 - 1], got {self.seed}")

    def with_max_new_tokens(self, value: int) -> Sampling:
        return Sampling(value, self.temperature, self.seed, self.top_p)
