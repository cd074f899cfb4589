"""The scheduler's logic, transport-free: sessions, chat turns, placement, resume.

A session lives in the store (transcript, policy, model, worker, footprint). Its KV lives on at
most one worker; a turn that finds no live placement (new session, idle TTL expired, worker
died, scheduler restarted and the worker forgot it) re-places the session by replaying the
transcript on a worker with room. A turn is acknowledged (``TurnDone``) only after the store
recorded it atomically; if anything fails first, the worker's copy is dropped so the next turn
replays exactly the acknowledged transcript.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Generator, Sequence

from scheduler_svc.cluster import Cluster
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.domain import (
    ROLES,
    ClusterStats,
    Message,
    QueuedEvent,
    SessionRecord,
    SessionView,
    TokenEvent,
    TurnDone,
    TurnResult,
)
from scheduler_svc.errors import (
    InvalidArgument,
    NotFound,
    SchedulerError,
    StoreUnavailable,
    Unavailable,
    WorkerRefused,
    WorkerUnavailable,
)
from scheduler_svc.store import SessionStore, new_session_id
from scheduler_svc.workers import WorkerClient

log = logging.getLogger("confkv.scheduler")
Sampling = tuple[int, float, int]  # (max_new_tokens, temperature, seed) as WorkerClient.turn takes them


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
        self._adopted = False

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, background: bool = True) -> None:
        """Poll workers, take back placements recorded in the store, start housekeeping."""
        self.cluster.poll()
        self._adopt()
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
        """One housekeeping round: poll footprints, release idle sessions, retry adoption."""
        self.cluster.poll()
        if not self._adopted:
            self._adopt()
        if self.config.idle_ttl_s is not None:
            for session_id, address in self.cluster.idle_sessions(self.config.idle_ttl_s):
                log.info("session %s idle: releasing its KV on %s (transcript kept)", session_id, address)
                self._unplace(session_id, address)

    def _adopt(self) -> None:
        """After a restart, keep sessions whose worker still holds them; drop what nobody owns."""
        try:
            records = self.store.list(limit=1_000_000)
        except StoreUnavailable as err:
            log.warning("cannot read placements yet: %s", err)
            return
        claimed: set[tuple[str, str]] = set()
        for record in records:
            if record.worker and self.cluster.adopt(record.session_id, record.worker, record.footprint_bytes):
                claimed.add((record.session_id, record.worker))
        for address, report in list(self.cluster.reports.items()):
            for session_id in report.session_bytes:
                if (session_id, address) not in claimed:
                    self._drop_quietly(address, session_id)
        self._adopted = True

    # -- sessions --------------------------------------------------------------------------------
    def create_session(
        self, model: str = "", policy: str = "", messages: list[Message] | None = None
    ) -> SessionRecord:
        model = model.strip() or self.cluster.default_model()
        policy = policy.strip() or self.config.default_policy
        self.cluster.reservation(model, policy)  # validates the policy and the model
        transcript = [self._check_message(m, what="transcript message") for m in messages or []]
        now = self.clock()
        record = SessionRecord(
            session_id=new_session_id(),
            model=model,
            policy=policy,
            max_new_tokens=self.config.default_max_new_tokens,
            transcript=transcript,
            created_at=now,
            updated_at=now,
        )
        self.store.create(record)
        return record

    def get_session(self, session_id: str) -> SessionView:
        return self.cluster.view(self.store.get(_check_id(session_id)))

    def list_sessions(self, limit: int = 100, offset: int = 0) -> list[SessionView]:
        if not 1 <= limit <= 10_000 or offset < 0:
            raise InvalidArgument(f"page size must be in [1, 10000] and offset >= 0, got {limit}, {offset}")
        return [self.cluster.view(r) for r in self.store.list(limit, offset)]

    def end_session(self, session_id: str) -> None:
        if not self.store.delete(_check_id(session_id)):
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

    # -- turns -------------------------------------------------------------------------------------
    def chat(
        self,
        session_id: str,
        message: Message,
        max_new_tokens: int = 0,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> Generator[ChatEvent, None, None]:
        """Validate now, then return the turn's events: maybe QueuedEvent, tokens, one TurnDone."""
        _check_id(session_id)
        message = self._check_message(message, what="message")
        if message.role not in ("user", "tool"):
            raise InvalidArgument(f"a turn starts with a 'user' or 'tool' message, got role {message.role!r}")
        if not 0.0 <= temperature <= 10.0:
            raise InvalidArgument(f"temperature must be in [0, 10], got {temperature}")
        record = self.store.get(session_id)
        limit = self._max_new_tokens(max_new_tokens, record.max_new_tokens)
        self.cluster.begin_turn(session_id)
        return self._turn(record, message, (limit, temperature, seed))

    def _turn(
        self, record: SessionRecord, message: Message, sampling: Sampling
    ) -> Generator[ChatEvent, None, None]:
        session_id, committed = record.session_id, False
        try:
            address, result = yield from self._generate(record, message, sampling)
            reply = Message("assistant", result.reply)
            footprint = self.cluster.reserved(session_id)
            turns = self.store.append_turn(
                session_id, record.turns, [message, reply], address, footprint, self.clock()
            )
            committed = True
            yield TurnDone(turns, address, footprint, result)
        finally:
            self.cluster.end_turn(session_id)
            address = self.cluster.location(session_id)
            if not committed and address is not None:
                # The worker may hold an unrecorded (partial) turn: drop it so the next turn
                # replays exactly the acknowledged transcript.
                self._unplace(session_id, address)

    def _generate(self, record: SessionRecord, message: Message, sampling: Sampling):
        """Run the turn on the session's worker, re-placing it once if the worker was lost
        before any token was streamed. Generator; returns (address, TurnResult)."""
        for attempt in range(2):
            address = yield from self._ensure_placed(record)
            streamed = False
            try:
                with contextlib.closing(
                    self.cluster.clients[address].turn(record.session_id, message, *sampling)
                ) as it:
                    for event in it:
                        if isinstance(event, TurnResult):
                            return address, event
                        streamed = True
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

    def _ensure_placed(self, record: SessionRecord):
        """The worker holding the session's KV, placing it (replaying the transcript) if needed.
        Generator: yields a QueuedEvent while waiting for room; returns the address."""
        address = self.cluster.location(record.session_id)
        if address is not None:
            return address
        need = self.cluster.reservation(record.model, record.policy)
        excluded: set[str] = set()
        last_error: SchedulerError = Unavailable("could not place the session")
        for _ in range(self.config.open_attempts):
            ticket = self.cluster.request(record.session_id, record.model, need, frozenset(excluded))
            try:
                if ticket.address is None:
                    yield QueuedEvent(self.cluster.position(ticket), f"waiting for {need} bytes of KV room")
                address = self.cluster.wait(ticket)
            except BaseException:
                self.cluster.cancel(ticket)
                raise
            try:
                # Workers refuse empty messages; an empty reply (EOS first) carries no tokens anyway.
                replay = [m for m in record.transcript if m.content.strip()]
                self.cluster.clients[address].open(record.session_id, record.policy, replay)
                self.store.set_placement(record.session_id, address, need)
                return address
            except (WorkerUnavailable, WorkerRefused) as err:
                last_error = err
                excluded.add(address)
                self.cluster.release(record.session_id)
                if isinstance(err, WorkerUnavailable):
                    self.cluster.worker_down(address, str(err))
            except BaseException:
                self._unplace(record.session_id, address)
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
        if not isinstance(message, Message) or message.role not in ROLES:
            raise InvalidArgument(f"{what}: role must be one of {', '.join(ROLES)}")
        if not message.content.strip():
            raise InvalidArgument(f"{what}: empty content")
        if len(message.content) > self.config.max_message_chars:
            raise InvalidArgument(f"{what}: longer than {self.config.max_message_chars} characters")
        return message

    def _max_new_tokens(self, requested: int, default: int) -> int:
        if requested < 0 or requested > self.config.max_new_tokens_limit:
            raise InvalidArgument(
                f"max_new_tokens must be in [0, {self.config.max_new_tokens_limit}], got {requested}"
            )
        return requested or default


ChatEvent = TokenEvent | QueuedEvent | TurnDone


def _check_id(session_id: str) -> str:
    if not isinstance(session_id, str) or not session_id or len(session_id) > 64:
        raise InvalidArgument("session_id must be a non-empty string of at most 64 characters")
    return session_id
