"""Domain types of the worker engine: config, errors, streamed events and footprint reports.

Units: ``*_bytes`` are exact stored KV bytes; ``*_tokens`` are tokens. Proto types never appear
here (the gRPC servicer translates).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from confkv import limits


class WorkerError(Exception):
    """Base of the errors a caller can act on (mapped to gRPC status codes by the servicer)."""


class InvalidRequest(WorkerError, ValueError):
    """Bad input: policy spec, empty/oversized message, negative max tokens (INVALID_ARGUMENT)."""


class SessionNotFound(WorkerError, LookupError):
    """No session with that id on this worker (NOT_FOUND)."""


class SessionExists(WorkerError):
    """The session id is already open on this worker (ALREADY_EXISTS)."""


class SessionBusy(WorkerError):
    """A turn is already queued or running in that session (FAILED_PRECONDITION)."""


class PoolExhausted(WorkerError):
    """The KV pool, the context limit or the wait queue cannot take the work (RESOURCE_EXHAUSTED)."""


class ShuttingDown(WorkerError):
    """The engine is draining and takes no new work (UNAVAILABLE)."""


class InternalError(WorkerError):
    """A decode step failed; the turn is abandoned, the worker keeps serving (INTERNAL)."""


# pool sizes travel as int64 (WorkerInfo, WorkerFootprint): a larger one could not be reported
MAX_POOL_BYTES = 2**63 - 1


@dataclass(frozen=True)
class EngineConfig:
    kv_pool_bytes: int
    max_batch_size: int = 16
    max_queue: int = 64
    prefill_chunk: int = 256
    default_max_new_tokens: int = 256
    max_new_tokens_limit: int = limits.MAX_NEW_TOKENS_LIMIT
    max_context_tokens: int = 8192
    default_policy: str = "confkv"
    worker_id: str = "worker"
    host_pool_bytes: int | None = None  # cold tiers (recall=1) in host memory; None: no limit
    # hot-pool pressure demotes an idle recall=1 session's hot cache to its cold tier (False:
    # release it; its next turn re-reads the conversation)
    demote_idle: bool = True
    # prompt chunks ride in the decode batch's forward (False: each chunk in its own forward first,
    # the reference path the benchmark compares time to first token against)
    packed_prefill: bool = True
    # the model's linears through oneDNN inside the engine's steps on the CPU (``confkv.linear``;
    # False: PyTorch's ``F.linear``, the path transformers' ``generate`` takes)
    onednn_linears: bool = True
    # a decode batch's members that must evict at a layer do so in one call (``confkv.evict_rows``;
    # False: each on its own, the reference the benchmark compares against; the same tokens)
    evict_by_rows: bool = True

    def __post_init__(self) -> None:
        positive = (
            "kv_pool_bytes", "max_batch_size", "prefill_chunk", "default_max_new_tokens",
            "max_new_tokens_limit", "max_context_tokens",
        )  # fmt: skip
        if self.host_pool_bytes is not None and self.host_pool_bytes <= 0:
            raise ValueError(f"host_pool_bytes must be positive, got {self.host_pool_bytes}")
        for name in ("kv_pool_bytes", "host_pool_bytes"):
            if (size := getattr(self, name) or 0) > MAX_POOL_BYTES:
                raise ValueError(f"EngineConfig.{name} must be <= {MAX_POOL_BYTES}, got {size}")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} must be positive, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise ValueError(f"EngineConfig.max_queue must be >= 0, got {self.max_queue}")
        if self.max_new_tokens_limit > limits.MAX_NEW_TOKENS_LIMIT:
            raise ValueError(f"EngineConfig.max_new_tokens_limit must be <= {limits.MAX_NEW_TOKENS_LIMIT}")
        if self.default_max_new_tokens > self.max_new_tokens_limit:
            raise ValueError("EngineConfig.default_max_new_tokens exceeds max_new_tokens_limit")


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class FinishReason(enum.Enum):
    EOS = "eos"
    MAX_TOKENS = "max_tokens"
    CANCELLED = "cancelled"
    CONTEXT = "context"
    SHUTDOWN = "shutdown"


class SessionState(enum.Enum):
    IDLE = "idle"
    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class TurnRequest:
    session_id: str
    messages: tuple[ChatMessage, ...]
    max_new_tokens: int = 0  # 0 = engine default
    temperature: float = 0.0
    seed: int = 0
    top_p: float = 1.0
    request_id: str = ""
    ignore_eos: bool = False  # benchmarks: always generate max_new_tokens (not on the wire)


@dataclass(frozen=True)
class SessionReport:
    session_id: str
    policy: str
    state: SessionState
    kv_bytes: int
    reserved_bytes: int
    peak_bytes: int
    budget_tokens: int
    cached_tokens: int
    context_tokens: int
    turns: int
    cold_bytes: int = 0  # recall=1: the session's cold tier (host memory on a GPU)


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str
    index: int
    session_bytes: int
    budget_tokens: int


@dataclass(frozen=True)
class TurnDone:
    reason: FinishReason
    text: str
    prompt_tokens: int
    generated_tokens: int
    context_tokens: int
    session: SessionReport
    seconds: float
    queued_seconds: float


@dataclass(frozen=True)
class TurnFailed:
    """The turn could not run (e.g. admission refused after queueing); ``error`` says why."""

    error: WorkerError


@dataclass(frozen=True)
class Estimate:
    worst_case_bytes: int
    policy_bound_bytes: int  # 0 = unbounded (full)
    resolved_policy: str
    context_tokens: int
    fits_pool: bool  # the worst case fits the KV pool and, with recall=1, its cold tier the host pool


@dataclass(frozen=True)
class Footprint:
    worker_id: str
    capacity_bytes: int
    used_bytes: int
    reserved_bytes: int
    active_sessions: int
    queued_requests: int
    open_sessions: int
    batch_size: int
    tokens_per_second: float
    draining: bool
    sessions: tuple[SessionReport, ...] = field(default_factory=tuple)
    host_capacity_bytes: int = 0  # 0 = unbounded
    host_used_bytes: int = 0
    host_reserved_bytes: int = 0
