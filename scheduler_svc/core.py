"""The scheduler's logic, transport-free: sessions, chat turns, placement, resume.

A session lives in the store (transcript, policy, model, owner, worker, footprint): the store is
the source of truth, a worker's copy only a cache. Its KV lives on at most one worker; a turn
that finds no live placement (new session, idle TTL expired, worker died, scheduler restarted)
re-places the session by replaying the stored transcript on a worker with room. A turn is
acknowledged (``TurnDone``) only after the store recorded it atomically under its request id;
if anything fails first, the worker's copy is dropped so the next turn replays exactly the
acknowledged transcript, and a retry with the same request id is answered from the store
instead of being recorded twice. Sessions belong to the principal that created them.

Stop sequences (``chat(stop=...)``) are applied here, so every front end records the same thing:
the reply is cut before the first stop sequence, text that might start one is held back while
streaming, and the turn recorded is exactly the text released. The worker cannot stop early, so
it finishes the turn (its count of tokens stays exact) and its copy, which holds the uncut reply,
is dropped: the next turn replays the recorded transcript.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Generator, Sequence

from confkv import limits
from scheduler_svc.cluster import Cluster
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.domain import (
    ClusterStats,
    Message,
    QueuedEvent,
    Sampling,
    SessionRecord,
    SessionView,
    TokenEvent,
    TurnDone,
    TurnResult,
)
from scheduler_svc.errors import (
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SchedulerError,
    StoreUnavailable,
    Unavailable,
    WorkerRefused,
    WorkerUnavailable,
)
from scheduler_svc.stops import StopMatcher, check_stops, cut_result
from scheduler_svc.store import SessionStore, new_session_id
from scheduler_svc.workers import WorkerClient

log = logging.getLogger("confkv.scheduler")
ANONYMOUS = "anonymous"  # the principal of every caller when no client tokens are configured
HealthListener = Callable[[bool, str], None]


class Scheduler:
    def __init__(
        self,
        store: SessionStore,
        workers: Sequence[WorkerClient],
        config: SchedulerConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.config = config or SchedulerConfig()
        self.cluster = Cluster(workers, self.config)
        self.clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.store_ok: bool | None = None  # None = not checked yet
        self.health_listeners: list[HealthListener] = []
        self._next_store_log = 0.0
        self._store_backoff = 1.0

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, background: bool = True) -> None:
        """Check the store, poll workers (dropping every session they hold: nothing is placed
        yet, and the store, not a worker, holds the truth), start housekeeping."""
        self.check_store()
        self.cluster.poll()
        if background:
            self._thread = threading.Thread(
                target=self._housekeeping, name="scheduler-housekeeping", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _housekeeping(self) -> None:
        while not self._stop.wait(self.config.poll_interval_s):
            try:
                self.tick()
            except Exception:  # never let the housekeeping thread die
                log.exception("scheduler housekeeping failed")

    def tick(self) -> None:
        """One housekeeping round: check the store, poll and reconcile workers, release idle KV."""
        self.check_store()
        self.cluster.poll()
        if self.config.idle_ttl_s is not None:
            for session_id, address in self.cluster.idle_sessions(self.config.idle_ttl_s):
                log.info("session %s idle: releasing its KV on %s (transcript kept)", session_id, address)
                self._unplace(session_id, address)

    def check_store(self) -> bool:
        """Ping the store; tell health listeners when it goes down or comes back, and log while
        it stays down with exponential back-off (1 s, 2 s, ... 60 s)."""
        try:
            self.store.ping()
            ok, reason = True, ""
        except StoreUnavailable as err:
            ok, reason = False, str(err)
        now = time.monotonic()
        if ok != self.store_ok:
            self.store_ok, self._store_backoff, self._next_store_log = ok, 1.0, now + 1.0
            if ok:
                log.info("session store reachable: serving")
            else:
                log.warning("session store unreachable: health NOT_SERVING until it answers (%s)", reason)
            for listener in self.health_listeners:
                listener(ok, reason)
        elif not ok and now >= self._next_store_log:
            self._store_backoff = min(self._store_backoff * 2, 60.0)
            self._next_store_log = now + self._store_backoff
            log.warning(
                "session store still unreachable (next report in %.0f s): %s", self._store_backoff, reason
            )
        return ok

    # -- sessions --------------------------------------------------------------------------------
    def create_session(
        self,
        model: str = "",
        policy: str = "",
        messages: list[Message] | None = None,
        principal: str = ANONYMOUS,
        request_id: str = "",
    ) -> SessionRecord:
        """A new session of ``principal``'s, or the one its ``request_id`` already created (a retry)."""
        model = model.strip() or self.cluster.default_model()
        policy = policy.strip() or self.config.default_policy
        messages = messages or []
        try:
            limits.check_request_id(request_id)
            limits.check_message_count(len(messages))
        except ValueError as err:
            raise InvalidArgument(str(err)) from None
        transcript = [self._check_message(m, what="transcript message") for m in messages]
        need = self.cluster.reservation(model, policy)  # validates the policy and the model
        largest = self.cluster.placer_capacity(model)
        if need > largest:
            raise ResourceExhausted(
                f"a {policy!r} session needs up to {need} KV bytes, more than the largest worker pool "
                f"({largest} bytes), so it could never run: choose a bounded policy (e.g. window:n=512 "
                "or bytes=...), or give the workers a larger --kv-pool-bytes"
            )
        host_need = self.cluster.host_reservation(model, policy)
        host = self.cluster.host_capacity(model)
        if host is not None and host_need > host:
            raise ResourceExhausted(
                f"a {policy!r} session's cold tier needs up to {host_need} host bytes, more than the "
                f"largest worker host pool ({host} bytes): bound it with cold_bytes=N, or give the "
                "workers a larger --host-pool-bytes"
            )
        self._check_fits(model, transcript, None)
        now = self.clock()
        record = SessionRecord(
            session_id=new_session_id(),
            model=model,
            policy=policy,
            max_new_tokens=self.config.default_max_new_tokens,
            transcript=transcript,
            created_at=now,
            updated_at=now,
            owner=principal,
        )
        stored = self.store.create(record, request_id)
        if stored.session_id != record.session_id and (stored.model, stored.policy) != (model, policy):
            raise InvalidArgument(f"request id {request_id!r} created a session of another model or policy")
        return stored

    def get_session(self, session_id: str, principal: str = ANONYMOUS) -> SessionView:
        return self.cluster.view(self._owned(session_id, principal))

    def list_sessions(
        self, limit: int = 100, offset: int = 0, principal: str = ANONYMOUS
    ) -> list[SessionView]:
        if not 1 <= limit <= 10_000 or not 0 <= offset <= 10**9:
            raise InvalidArgument(
                f"page size must be in [1, 10000] and offset in [0, 1e9], got {limit}, {offset}"
            )
        return [self.cluster.view(r) for r in self.store.list(principal, limit, offset)]

    def end_session(self, session_id: str, principal: str = ANONYMOUS) -> None:
        self._owned(session_id, principal)
        if not self.store.delete(session_id):
            raise NotFound(f"unknown session {session_id!r}")
        address = self.cluster.release(session_id)
        if address:
            self._drop_quietly(address, session_id)

    def stats(self) -> ClusterStats:
        try:
            sessions = self.store.count()
        except StoreUnavailable:
            sessions = -1
        return self.cluster.stats(sessions)

    def _owned(self, session_id: str, principal: str) -> SessionRecord:
        """The record, if ``principal`` owns it; NotFound otherwise (no existence oracle)."""
        record = self.store.get(_check_id(session_id))
        if record.owner != principal:
            raise NotFound(f"unknown session {session_id!r}")
        return record

    # -- turns -------------------------------------------------------------------------------------
    def chat(
        self,
        session_id: str,
        message: Message,
        max_new_tokens: int = 0,
        temperature: float = 0.0,
        seed: int = 0,
        *,
        top_p: float = 1.0,
        principal: str = ANONYMOUS,
        request_id: str = "",
        cancelled: threading.Event | None = None,
        stop: Sequence[str] = (),
    ) -> Generator[ChatEvent, None, None]:
        """Validate now, then return the turn's events: maybe QueuedEvent, tokens, one TurnDone.
        A ``request_id`` already recorded in the session answers with that turn (``replayed``).
        ``stop``: up to 4 stop sequences; a reply cut at one finishes with reason ``"stop"``."""
        _check_id(session_id)
        message = self._check_message(message, what="message")
        if message.role not in limits.TURN_ROLES:
            raise InvalidArgument(f"a turn starts with a 'user' or 'tool' message, got role {message.role!r}")
        try:
            limits.check_request_id(request_id)
            limits.check_max_new_tokens(max_new_tokens, self.config.max_new_tokens_limit)
            sampling = Sampling(max_new_tokens, temperature, seed, top_p)
            stops = check_stops(stop)
        except ValueError as err:
            raise InvalidArgument(str(err)) from None
        record = self._owned(session_id, principal)
        if request_id:
            recorded = self.store.recorded(session_id, request_id)
            if recorded is not None:
                return _replay(recorded)
        self._check_fits(record.model, [*record.transcript, message], record)
        sampling = sampling.with_max_new_tokens(sampling.max_new_tokens or record.max_new_tokens)
        self.cluster.begin_turn(session_id)
        return self._turn(record, message, sampling, request_id, cancelled, stops)

    def _turn(
        self,
        record: SessionRecord,
        message: Message,
        sampling: Sampling,
        request_id: str,
        cancelled: threading.Event | None,
        stops: tuple[str, ...] = (),
    ) -> Generator[ChatEvent, None, None]:
        session_id, committed, worker_copy_stale = record.session_id, False, False
        try:
            address, result = yield from self._generate(
                record, message, sampling, request_id, cancelled, stops
            )
            # Cut at a stop: the worker committed the uncut reply, so its copy must go.
            worker_copy_stale = result.finish_reason == "stop"
            reply = Message("assistant", result.reply)
            footprint = self.cluster.reserved(session_id)
            done = self.store.append_turn(
                session_id, record.turns, [message, reply], address, footprint, self.clock(), request_id
            )
            if done.replayed:  # a concurrent retry recorded it first: answer with the stored turn
                yield _done_from(done)
                return
            committed = True
            yield TurnDone(done.turn, address, footprint, result)
        finally:
            self.cluster.end_turn(session_id)
            address = self.cluster.location(session_id)
            if (not committed or worker_copy_stale) and address is not None:
                # The worker may hold an unrecorded (partial) turn, or a reply other than the one
                # recorded: drop it so the next turn replays exactly the acknowledged transcript.
                self._unplace(session_id, address)

    def _generate(
        self,
        record: SessionRecord,
        message: Message,
        sampling: Sampling,
        request_id: str,
        cancelled: threading.Event | None,
        stops: tuple[str, ...] = (),
    ):
        """Run the turn on the session's worker, re-placing it once if the worker was lost
        before any token was streamed. Generator; returns (address, TurnResult)."""
        for attempt in range(2):
            address = yield from self._ensure_placed(record, cancelled)
            streamed, matcher = False, StopMatcher(stops)
            stopped_at: TokenEvent | None = None  # the token that completed a stop sequence
            try:
                with contextlib.closing(
                    self.cluster.clients[address].turn(record.session_id, message, sampling, request_id)
                ) as it:
                    for event in it:
                        if isinstance(event, TurnResult):
                            return address, cut_result(event, matcher, stopped_at)
                        streamed = True
                        if stops and isinstance(event, TokenEvent):
                            if matcher.matched:
                                continue  # past the stop: the worker finishes, nothing is shown
                            event = dataclasses.replace(event, text=matcher.push(event.text))
                            stopped_at = event if matcher.matched else None
                        yield event
                raise WorkerUnavailable(f"worker {address} ended the turn without a result")
            except (WorkerUnavailable, NotFound) as err:
                if isinstance(err, WorkerUnavailable):
                    self.cluster.worker_down(address, str(err))
                self.cluster.release(record.session_id)
                if streamed or attempt == 1:
                    raise Unavailable(
                        f"worker {address} failed during the turn ({err}); "
                        "the turn was not recorded, send it again"
                    ) from None
                log.info(
                    "session %s: worker %s lost it before the turn; re-placing", record.session_id, address
                )
        raise AssertionError("unreachable")

    def _ensure_placed(self, record: SessionRecord, cancelled: threading.Event | None):
        """Reserve room for the turn and return the worker that will run it: the session's
        current worker when it has room (warm KV), else another one, where the stored transcript
        is replayed. Generator: yields a QueuedEvent while waiting for room; returns the address."""
        session_id = record.session_id
        need = self.cluster.reservation(record.model, record.policy)
        host_need = self.cluster.host_reservation(record.model, record.policy)
        excluded: set[str] = set()
        last_error: SchedulerError = Unavailable("could not place the session")
        for _ in range(self.config.open_attempts):
            current = self.cluster.location(session_id)
            ticket = self.cluster.request(session_id, record.model, need, frozenset(excluded), host_need)
            try:
                if ticket.address is None:
                    host = f" and {host_need} host bytes for its cold tier" if host_need else ""
                    waiting = f"waiting for {need} bytes of KV room{host}"
                    yield QueuedEvent(self.cluster.position(ticket), waiting)
                address = self.cluster.wait(ticket, cancelled)
            except BaseException:
                self.cluster.cancel(ticket)
                raise
            if address == current:
                return address
            if current is not None:  # moved: the old copy must not linger
                self._drop_quietly(current, session_id)
            try:
                # Workers refuse empty messages; an empty reply (EOS first) carries no tokens anyway.
                replay = [m for m in record.transcript if m.content.strip()]
                self.cluster.clients[address].open(session_id, record.policy, replay)
                self.store.set_placement(session_id, address, need)
                return address
            except (WorkerUnavailable, WorkerRefused) as err:
                last_error = err
                excluded.add(address)
                self.cluster.release(session_id)
                if isinstance(err, WorkerUnavailable):
                    self.cluster.worker_down(address, str(err))
            except BaseException:
                self._unplace(session_id, address)
                raise
        raise last_error

    # -- helpers -------------------------------------------------------------------------------------
    def _unplace(self, session_id: str, address: str) -> None:
        self.cluster.release(session_id)
        self._drop_quietly(address, session_id)
        try:
            self.store.set_placement(session_id, "", 0)
        except StoreUnavailable:
            pass  # advisory only: a restart re-checks placements against the workers' reports

    def _drop_quietly(self, address: str, session_id: str) -> None:
        try:
            self.cluster.clients[address].drop(session_id)
        except SchedulerError as err:
            log.info(
                "drop of %s on %s failed (%s); the worker will be reconciled later", session_id, address, err
            )

    def _check_message(self, message: Message, what: str) -> Message:
        if not isinstance(message, Message):
            raise InvalidArgument(f"{what}: not a message")
        try:
            limits.check_role(message.role, what)
            limits.check_text(message.content, what)
        except ValueError as err:
            raise InvalidArgument(str(err)) from None
        return message

    def _check_fits(self, model: str, transcript: Sequence[Message], record: SessionRecord | None) -> None:
        """A transcript longer than any context could hold is refused before anyone tokenizes it."""
        cap = self.cluster.max_transcript_chars(model) or limits.MAX_TRANSCRIPT_CHARS
        total = sum(len(m.content) for m in transcript)
        if total > cap:
            what = "this session is full" if record is not None else "the transcript is too long"
            raise ResourceExhausted(
                f"{what}: {total} characters, more than the {cap} a {model!r} context can hold; "
                "start a new session"
            )


ChatEvent = TokenEvent | QueuedEvent | TurnDone


def _check_id(session_id: str) -> str:
    try:
        return limits.check_session_id(session_id)
    except ValueError as err:
        raise InvalidArgument(str(err)) from None


def _done_from(recorded) -> TurnDone:
    result = TurnResult(recorded.reply, "replayed")
    return TurnDone(recorded.turn, recorded.worker, recorded.footprint, result, replayed=True)


def _replay(recorded) -> Generator[ChatEvent, None, None]:
    """A retried request id: the recorded turn, nothing run again."""
    yield _done_from(recorded)
