"""Domain types shared by the scheduler's core, store and worker clients (no proto, no tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field

from confkv.limits import ROLES, Sampling
from confkv.memory import KVGeometry

__all__ = ["ROLES", "Sampling"]  # re-exported: the one definition lives in confkv.limits


@dataclass(frozen=True)
class Message:
    role: str
    content: str

    def to_dict(self) -> dict:
        return {"role": self.role, "content": self.content}

    @classmethod
    def from_dict(cls, data: dict) -> Message:
        return cls(str(data["role"]), str(data["content"]))


@dataclass
class SessionRecord:
    """What the store keeps per session. ``worker`` is empty while no KV is held anywhere;
    ``footprint_bytes`` is the KV reservation (worst-case bytes) the session holds when placed."""

    session_id: str
    model: str
    policy: str
    max_new_tokens: int = 256
    transcript: list[Message] = field(default_factory=list)
    worker: str = ""
    footprint_bytes: int = 0
    created_at: float = 0.0
    updated_at: float = 0.0
    turns: int = 0  # acknowledged turns (user message + assistant reply each)
    owner: str = ""  # the principal that created it; nobody else sees it


@dataclass(frozen=True)
class WorkerReport:
    """A worker's footprint report. Bytes are exact stored KV bytes; ``session_bytes`` maps the
    sessions the worker holds to their current bytes."""

    address: str
    model: str
    geometry: KVGeometry
    max_context: int
    capacity_bytes: int
    used_bytes: int
    session_bytes: dict[str, int] = field(default_factory=dict)
    active: int = 0
    queued: int = 0
    max_transcript_chars: int = 0  # 0 = unknown (then only the shared absolute cap applies)
    # the host pool for recall=1 cold tiers: 0 capacity = no limit (or an older worker)
    host_capacity_bytes: int = 0
    host_used_bytes: int = 0
    session_cold_bytes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class TokenEvent:
    """One generated token, as streamed. ``text`` is the text delta (may be empty mid-character)."""

    text: str
    token_id: int = -1
    index: int = 0
    session_bytes: int = 0
    budget_tokens: int = 0


@dataclass(frozen=True)
class QueuedEvent:
    """The turn waits for KV room; ``position`` is its place in its model's queue (1 = next)."""

    position: int
    reason: str


@dataclass(frozen=True)
class TurnResult:
    """The worker's last event of a turn (its reply as committed to the worker's transcript)."""

    reply: str
    finish_reason: str  # "eos" | "max_tokens" | "cancelled" | "context" | "shutdown"
    prompt_tokens: int = 0
    generated_tokens: int = 0
    context_tokens: int = 0
    kv_bytes: int = 0
    peak_bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class TurnDone:
    """The turn was written to the store: from here on it is acknowledged."""

    turn: int
    worker: str
    footprint_bytes: int
    result: TurnResult
    replayed: bool = False  # the request id was already recorded: this is that turn, not a new one


@dataclass(frozen=True)
class SessionView:
    """A stored session plus its live state: "idle" (KV held), "running", "queued",
    "released" (no KV anywhere; the next turn rebuilds it)."""

    record: SessionRecord
    state: str
    kv_bytes: int
    worker: str
    reserved_bytes: int


@dataclass(frozen=True)
class WorkerStats:
    address: str
    model: str
    healthy: bool
    capacity_bytes: int
    used_bytes: int
    reserved_bytes: int
    sessions: int
    active: int = 0
    queued: int = 0
    error: str = ""


@dataclass(frozen=True)
class ClusterStats:
    workers: list[WorkerStats]
    sessions: int
    placed_sessions: int
    queued: int
    queue_limit: int
