"""Typed scheduler configuration (flags are read only at the CLI entry point)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """queue_limit: placements that may wait for KV room; admission_timeout_s: how long one
    waits before RESOURCE_EXHAUSTED; idle_ttl_s: a session idle this long releases its KV (its
    transcript stays; None = never); poll_interval_s: worker footprint polling period."""

    queue_limit: int = 64
    admission_timeout_s: float = 30.0
    idle_ttl_s: float | None = 600.0
    poll_interval_s: float = 1.0
    max_message_chars: int = 32_768
    max_new_tokens_limit: int = 4096
    default_max_new_tokens: int = 256
    open_attempts: int = 3
    default_policy: str = "confkv"

    def __post_init__(self) -> None:
        if self.queue_limit < 0:
            raise ValueError(f"queue_limit must be >= 0, got {self.queue_limit}")
        if self.admission_timeout_s < 0:
            raise ValueError(f"admission_timeout_s must be >= 0, got {self.admission_timeout_s}")
        if self.idle_ttl_s is not None and self.idle_ttl_s <= 0:
            raise ValueError(f"idle_ttl_s must be positive or None, got {self.idle_ttl_s}")
        if self.poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be positive, got {self.poll_interval_s}")
        if self.max_message_chars < 1 or self.max_new_tokens_limit < 1 or self.open_attempts < 1:
            raise ValueError("max_message_chars, max_new_tokens_limit and open_attempts must be >= 1")
        from confkv.policies import parse_policy

        parse_policy(self.default_policy)  # raises ValueError with the reason
        if not 1 <= self.default_max_new_tokens <= self.max_new_tokens_limit:
            raise ValueError(
                f"default_max_new_tokens must be in [1, {self.max_new_tokens_limit}], "
                f"got {self.default_max_new_tokens}"
            )
