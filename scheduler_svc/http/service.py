"""The chat-completions call in the scheduler's terms (blocking, no HTTP): which session a call
continues, the turn itself through ``Scheduler.chat``, and the prefix index kept up to date.

Session choice, in order: the ``X-Confkv-Session-Id`` header (the caller's own session; its
messages must be the stored transcript plus one new message, or only the new message); else the
prefix index (the same caller, model and transcript, policy compatible); else a new session
holding the call's history, whose first turn replays it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass

from confkv.policies import parse_policy
from scheduler_svc.core import ChatEvent, Scheduler
from scheduler_svc.domain import Message, TurnDone
from scheduler_svc.errors import Conflict, NotFound, SchedulerError
from scheduler_svc.http.errors import ApiError, from_scheduler
from scheduler_svc.http.schemas import TurnRequest
from scheduler_svc.http.session_index import PrefixIndex, canonical, transcript_key

log = logging.getLogger("confkv.http")
SESSION_HEADER = "X-Confkv-Session-Id"


@dataclass(frozen=True)
class Resolved:
    """The session a call runs in. ``history``: its stored transcript before this turn."""

    session_id: str
    model: str
    policy: str
    new_session: bool
    history: tuple[Message, ...]


def _same_policy(a: str, b: str) -> bool:
    try:
        return parse_policy(a).spec() == parse_policy(b).spec()
    except ValueError:
        return False


class ChatService:
    def __init__(self, scheduler: Scheduler, index: PrefixIndex) -> None:
        self.scheduler, self.index = scheduler, index

    def served_models(self) -> list[str]:
        return sorted({w.model for w in self.scheduler.cluster.stats(0).workers if w.model})

    # -- choosing the session --------------------------------------------------------------------
    def _check_request(self, turn: TurnRequest) -> None:
        served = self.served_models()
        if not served:
            raise ApiError(503, "no worker has reported yet; is any worker running?", code="unavailable")
        if turn.model not in served:
            raise ApiError(
                404,
                f"the model {turn.model!r} does not exist here; served: {', '.join(served)}",
                "model",
                "model_not_found",
            )
        if turn.policy:
            try:
                parse_policy(turn.policy)
            except ValueError as err:
                raise ApiError(400, f"kv_policy: {err}", "kv_policy", "invalid_value") from None

    def _explicit(self, turn: TurnRequest, principal: str, session_id: str) -> Resolved:
        try:
            record = self.scheduler.get_session(session_id, principal).record
        except NotFound:
            raise ApiError(
                404, f"unknown session {session_id!r}", SESSION_HEADER, "session_not_found"
            ) from None
        if record.model != turn.model:
            raise ApiError(400, f"session {session_id!r} runs model {record.model!r}", "model")
        if turn.policy and not _same_policy(turn.policy, record.policy):
            raise ApiError(
                400,
                f"session {session_id!r} uses policy {record.policy!r}; kv_policy cannot change it",
                "kv_policy",
            )
        if turn.history and canonical(turn.history) != canonical(record.transcript):
            raise ApiError(
                409,
                f"the messages do not extend session {session_id!r}: send its stored transcript plus one "
                "new message, or only the new message",
                "messages",
                "transcript_mismatch",
            )
        return Resolved(record.session_id, record.model, record.policy, False, tuple(record.transcript))

    def _lookup(self, turn: TurnRequest, principal: str) -> Resolved | None:
        if not turn.history:
            return None
        session_id = self.index.get(transcript_key(principal, turn.model, turn.history))
        if session_id is None:
            return None
        try:
            record = self.scheduler.get_session(session_id, principal).record
        except NotFound:  # ended or expired since
            return None
        if record.model != turn.model or canonical(record.transcript) != canonical(turn.history):
            return None
        if turn.policy and not _same_policy(turn.policy, record.policy):
            return None  # a different policy is a different cache: a new session
        return Resolved(record.session_id, record.model, record.policy, False, tuple(record.transcript))

    def _create(self, turn: TurnRequest, principal: str) -> Resolved:
        record = self.scheduler.create_session(turn.model, turn.policy, list(turn.history), principal)
        return Resolved(record.session_id, record.model, record.policy, True, tuple(record.transcript))

    def _chat(
        self, resolved: Resolved, turn: TurnRequest, principal: str, gone: threading.Event
    ) -> Generator[ChatEvent, None, None]:
        return self.scheduler.chat(
            resolved.session_id,
            turn.message,
            turn.max_new_tokens,
            turn.temperature,
            turn.seed,
            top_p=turn.top_p,
            principal=principal,
            cancelled=gone,
            stop=turn.stops,
        )

    def start(
        self, turn: TurnRequest, principal: str, session_id: str | None, gone: threading.Event
    ) -> tuple[Resolved, Generator[ChatEvent, None, None]]:
        """Choose the session and start the turn (validated; nothing generated yet)."""
        self._check_request(turn)
        if session_id:
            resolved = self._explicit(turn, principal, session_id)
            return resolved, self._chat(resolved, turn, principal, gone)
        found = self._lookup(turn, principal)
        if found is not None:
            try:
                return found, self._chat(found, turn, principal, gone)
            except Conflict:  # the same conversation is running in another call: fork it
                log.info("session %s busy; the call forks a new session", found.session_id)
        resolved = self._create(turn, principal)
        return resolved, self._chat(resolved, turn, principal, gone)

    # -- the turn ------------------------------------------------------------------------------------
    def run(
        self,
        turn: TurnRequest,
        principal: str,
        session_id: str | None,
        emit: Callable[[object], None],
        gone: threading.Event,
    ) -> None:
        """Emit the Resolved session, then the turn's events (QueuedEvent, TokenEvent, TurnDone).
        Stops, closing the turn (nothing recorded), as soon as ``gone`` is set. ``ApiError`` on
        failure: a refusal before the turn started is the request's fault (400), after it a
        matter of capacity (429) or availability (503)."""
        try:
            resolved, events = self.start(turn, principal, session_id, gone)
        except SchedulerError as err:
            raise from_scheduler(err, started=False) from None
        emit(resolved)
        try:
            with contextlib.closing(events):
                for event in events:
                    if gone.is_set():
                        return
                    if isinstance(event, TurnDone):
                        self._remember(resolved, turn, principal, event)
                    emit(event)
        except SchedulerError as err:
            raise from_scheduler(err, started=True) from None

    def _remember(self, resolved: Resolved, turn: TurnRequest, principal: str, done: TurnDone) -> None:
        """Index the transcript the client now holds, so its next call continues this session."""
        transcript = [*resolved.history, turn.message, Message("assistant", done.result.reply)]
        try:
            self.index.put(transcript_key(principal, resolved.model, transcript), resolved.session_id)
            if not resolved.new_session:
                old = transcript_key(principal, resolved.model, resolved.history)
                self.index.discard(old, resolved.session_id)
        except SchedulerError as err:  # the turn is recorded; only the next call's match is lost
            log.warning("prefix index not updated for %s: %s", resolved.session_id, err)
