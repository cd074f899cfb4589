"""A hosted session (transcript + its own Conf-KV cache) and a turn in flight.

A session's cache always corresponds to ``fed_ids``, the exact tokens fed so far; a new turn
feeds only the suffix of the conversation's ids (encoded incrementally: ``worker_svc.prompt``),
or rebuilds the cache when the encoding diverged from what was fed (e.g. after its KV was
released).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from confkv.policies import CachePolicy
from confkv.sequence import SequenceCache
from worker_svc.output import Detokenizer
from worker_svc.prompt import EncodedPrefix, PromptEncoder
from worker_svc.types import (
    ChatMessage,
    SessionReport,
    SessionState,
    TokenEvent,
    TurnDone,
    TurnFailed,
    TurnRequest,
)


class TurnHandle:
    """The caller's side of a turn: a queue of ``TokenEvent`` ending with ``TurnDone`` or
    ``TurnFailed``, and ``cancel()`` (safe from any thread)."""

    def __init__(self, request: TurnRequest):
        self.request = request
        self.events: queue.Queue[TokenEvent | TurnDone | TurnFailed] = queue.Queue()
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def get(self, timeout: float | None = None) -> TokenEvent | TurnDone | TurnFailed:
        """Next event; raises ``queue.Empty`` after ``timeout`` seconds."""
        return self.events.get(timeout=timeout)

    def __iter__(self):
        while True:
            event = self.events.get()
            yield event
            if isinstance(event, TurnDone | TurnFailed):
                return


@dataclass
class Session:
    session_id: str
    policy: CachePolicy  # resolved for the model
    transcript: list[ChatMessage]
    seq: SequenceCache | None = None
    fed_ids: list[int] = field(default_factory=list)
    state: SessionState = SessionState.IDLE
    turn: Turn | None = None
    last_used: float = field(default_factory=time.monotonic)
    dropping: bool = False
    prompt: EncodedPrefix | None = None  # the rendered conversation's ids so far (not the KV's)

    def encode_prompt(self, encoder: PromptEncoder, conversation: Sequence[ChatMessage]) -> list[int]:
        """Ids of ``conversation`` (the transcript + the turn's messages), encoding only the text
        new since the last call; runs outside the engine lock (the prefix is replaced whole)."""
        ids, self.prompt = encoder.encode(conversation, self.prompt)
        return ids

    def nbytes(self) -> int:
        return self.seq.nbytes() if self.seq is not None else 0

    def cold_nbytes(self) -> int:
        """Bytes of the session's cold tier (host memory; 0 without recall)."""
        return self.seq.cold_nbytes() if self.seq is not None else 0

    def cold_reserved_bytes(self) -> int:
        """Host bytes the cold tier holds as allocated (``SequenceCache.cold_reserved_bytes``:
        whole page slots, at least ``cold_nbytes``): the host pool's charge between turns."""
        return self.seq.cold_reserved_bytes() if self.seq is not None else 0

    def release_kv(self) -> int:
        """Free the cache (the transcript stays; the next turn rebuilds it). Returns freed bytes.
        The engine gives back the session's pool reservation at the same time."""
        freed = self.nbytes()
        self.seq, self.fed_ids = None, []
        return freed

    def report(self, reserved_bytes: int) -> SessionReport:
        seq = self.seq
        return SessionReport(
            session_id=self.session_id,
            policy=self.policy.spec(),
            state=self.state,
            kv_bytes=self.nbytes(),
            reserved_bytes=reserved_bytes,
            peak_bytes=seq.stats.peak_bytes if seq else 0,
            budget_tokens=seq.budget if seq and self.policy.evicts else 0,
            cached_tokens=len(seq.stores[0]) if seq else 0,
            context_tokens=seq.seen_tokens if seq else 0,
            turns=len(self.transcript),
            cold_bytes=self.cold_nbytes(),
        )


@dataclass
class Turn:
    """Engine-side state of one turn; only the engine thread touches it while it is active."""

    session: Session
    handle: TurnHandle
    prompt_ids: list[int]  # the whole conversation, encoded, generation prompt included
    max_new_tokens: int  # after the context cap
    context_capped: bool
    reserve_bytes: int
    output: Detokenizer  # the reply's text deltas and committed text
    cold_reserve_bytes: int = 0  # host-pool bytes the turn may need (recall=1 cold tier)
    enqueued_at: float = field(default_factory=time.perf_counter)
    started_at: float = 0.0
    pending: list[int] = field(default_factory=list)  # prompt tokens still to feed
    prompt_tokens: int = 0  # prompt tokens this turn feeds (suffix, or all on a rebuild)
    fed: list[int] = field(default_factory=list)  # tokens fed during this turn
    generated: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # (V,) next-token logits once the prompt is in
    greedy: int | None = None  # argmax of ``logits`` when a batched step computed it for all
    generator: torch.Generator | None = None

    @property
    def request(self) -> TurnRequest:
        return self.handle.request
