"""Typed scheduler configuration (flags are read only at the CLI entry point)."""

from __future__ import annotations

from dataclasses import dataclass

from confkv import limits


@dataclass(frozen=True)
class SchedulerConfig:
    """queue_limit: placements that may wait for KV room; admission_timeout_s: how long one
    waits before RESOURCE_EXHAUSTED; idle_ttl_s: a session idle this long releases its KV (its
    transcript stays; None = never); poll_interval_s: worker footprint polling period;
    turn_timeout_s: the longest one turn may stream (a stuck worker cannot hang a client past it;
    a worker that stops answering polls is cut off sooner). Message limits: ``confkv.limits``."""

    queue_limit: int = 64
    admission_timeout_s: float = 30.0
    idle_ttl_s: float | None = 600.0
    poll_interval_s: float = 1.0
    max_new_tokens_limit: int = limits.MAX_NEW_TOKENS_LIMIT
    turn_timeout_s: float = 600.0
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
        if not 1 <= self.max_new_tokens_limit <= limits.MAX_NEW_TOKENS_LIMIT or self.open_attempts < 1:
            raise ValueError(
                f"max_new_tokens_limit must be in [1, {limits.MAX_NEW_TOKENS_LIMIT}] and open_attempts >= 1"
            )
        if self.turn_timeout_s <= 0:
            raise ValueError(f"turn_timeout_s must be positive, got {self.turn_timeout_s}")
        from confkv.policies import parse_policy

        parse_policy(self.default_policy)  # raises ValueError with the reason
        if not 1 <= self.default_max_new_tokens <= self.max_new_tokens_limit:
            raise ValueError(
                f"default_max_new_tokens must be in [1, {self.max_new_tokens_limit}], "
                f"got {self.default_max_new_tokens}"
            )
