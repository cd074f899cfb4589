"""The worker pool as the scheduler sees it: footprint reports, reservations, the admission
queue, in-flight turns and idle times, all behind one lock. Transport-free.

Every poll reconciles each worker with the scheduler's placements: sessions a worker holds that
the scheduler did not place there (it was marked down and came back, the scheduler restarted,
a drop failed) are dropped, so no KV leaks and no worker copy outlives what the store holds."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from confkv.policies import parse_policy
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.domain import ClusterStats, SessionRecord, SessionView, WorkerReport, WorkerStats
from scheduler_svc.errors import (
    Cancelled,
    Conflict,
    InvalidArgument,
    ResourceExhausted,
    SchedulerError,
    Unavailable,
)
from scheduler_svc.placement import AdmissionQueue, Placer, Ticket, reservation_bytes
from scheduler_svc.workers import WorkerClient

log = logging.getLogger("confkv.scheduler")


class Cluster:
    def __init__(
        self,
        workers: Sequence[WorkerClient],
        config: SchedulerConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not workers:
            raise ValueError("the scheduler needs at least one worker")
        self.clients = {w.address: w for w in workers}
        if len(self.clients) != len(workers):
            raise ValueError("worker addresses must be distinct")
        self.config, self.clock = config, clock
        self.placer = Placer()
        self.queue = AdmissionQueue(config.queue_limit)
        self.reports: dict[str, WorkerReport] = {}
        self._cond = threading.Condition()
        self._last_active: dict[str, float] = {}
        self._busy: set[str] = set()
        self._errors: dict[str, str] = {}

    # -- worker health ---------------------------------------------------------------------
    def poll(self) -> None:
        """Fetch every worker's footprint (a worker that does not answer is marked down) and
        drop what each worker holds that the scheduler did not place there."""
        for address, client in self.clients.items():
            try:
                report = client.report()
            except SchedulerError as err:
                self.worker_down(address, str(err))
                continue
            with self._cond:
                self.placer.update(report)
                self.reports[address] = report
                self._errors.pop(address, None)
                strays = self.placer.strays(address)
                self._drain()
            for session_id in strays:
                log.info(
                    "reconcile: dropping %s on %s (not placed there by this scheduler)", session_id, address
                )
                try:
                    client.drop(session_id)
                except SchedulerError as err:
                    log.info("reconcile drop of %s on %s failed: %s", session_id, address, err)

    def worker_down(self, address: str, reason: str = "") -> list[str]:
        with self._cond:
            was_healthy = address in self.placer.workers and self.placer.workers[address].healthy
            lost = self.placer.mark_down(address)
            self._errors[address] = reason
            self._cond.notify_all()
        if was_healthy:
            log.warning("worker %s is down (%s); %d session(s) will be re-placed", address, reason, len(lost))
            self.clients[address].cancel_calls()  # streams to a stuck worker end now, not never
        return lost

    def wake(self) -> None:
        """Wake waiters (a caller went away: its wait loop notices)."""
        with self._cond:
            self._cond.notify_all()

    # -- models and footprints ----------------------------------------------------------------
    def default_model(self) -> str:
        with self._cond:
            models = sorted({r.model for r in self.reports.values()})
        if not models:
            raise Unavailable("no worker has reported yet; is any worker running?")
        return models[0]

    def reservation(self, model: str, policy_spec: str) -> int:
        """Worst-case KV bytes of a session of ``policy_spec`` on ``model`` (validates both)."""
        return self._reservations(model, policy_spec)[0]

    def host_reservation(self, model: str, policy_spec: str) -> int:
        """Worst-case host (cold-tier) bytes of such a session; 0 without ``recall=1``."""
        return self._reservations(model, policy_spec)[1]

    def _reservations(self, model: str, policy_spec: str) -> tuple[int, int]:
        try:
            policy = parse_policy(policy_spec)
        except ValueError as err:
            raise InvalidArgument(str(err)) from None
        with self._cond:
            report = next((r for r in self.reports.values() if r.model == model), None)
            served = sorted({r.model for r in self.reports.values()})
        if report is None:
            raise InvalidArgument(f"no worker serves model {model!r}; served: {', '.join(served) or 'none'}")
        try:
            hot = reservation_bytes(policy, report.geometry, report.max_context)
        except ValueError as err:  # e.g. a byte budget too small for this model
            raise InvalidArgument(str(err)) from None
        return hot, policy.worst_case_cold_bytes(report.geometry, report.max_context)

    # -- placement -----------------------------------------------------------------------------
    def location(self, session_id: str) -> str | None:
        with self._cond:
            address = self.placer.location.get(session_id)
            return address if address and self.placer.workers[address].healthy else None

    def placer_capacity(self, model: str) -> int:
        """The largest pool among the model's workers (0 when none reported)."""
        with self._cond:
            return self.placer.largest_capacity(model)

    def host_capacity(self, model: str) -> int | None:
        """The largest host pool among the model's workers (None: one has no host limit)."""
        with self._cond:
            return self.placer.largest_host_capacity(model)

    def max_transcript_chars(self, model: str) -> int:
        with self._cond:
            caps = [r.max_transcript_chars for r in self.reports.values() if r.model == model]
        return min((c for c in caps if c > 0), default=0)

    def request(
        self,
        session_id: str,
        model: str,
        need: int,
        exclude: frozenset[str] = frozenset(),
        host_need: int = 0,
    ) -> Ticket:
        """Join the fair queue for ``need`` bytes; the ticket is admitted at once if room exists
        and nobody of the same model waits ahead. Raises when it can never or not now be queued."""
        with self._cond:
            if not self.placer.serves(model, healthy_only=True):
                raise Unavailable(f"no healthy worker serves model {model!r} right now; retry later")
            largest = self.placer.largest_capacity(model)
            if need > largest:
                raise ResourceExhausted(
                    f"this session needs up to {need} KV bytes, more than the largest worker pool "
                    f"({largest} bytes); choose a smaller budget (e.g. a bytes= policy)"
                )
            host = self.placer.largest_host_capacity(model)
            if host is not None and host_need > host:
                raise ResourceExhausted(
                    f"this session's cold tier needs up to {host_need} host bytes, more than the largest "
                    f"worker host pool ({host} bytes); bound it with cold_bytes=N"
                )
            ticket = self.queue.push(session_id, model, need, exclude, host_need)
            self._drain()
            self._mark_admitted(ticket)
            return ticket

    def position(self, ticket: Ticket) -> int:
        with self._cond:
            return self.queue.position(ticket)

    def wait(self, ticket: Ticket, cancelled: threading.Event | None = None) -> str:
        """Block until the ticket is admitted (returns the worker), admission_timeout_s passes
        (ResourceExhausted) or ``cancelled`` is set (Cancelled; the queue slot is freed)."""
        deadline = self.clock() + self.config.admission_timeout_s
        with self._cond:
            while ticket.address is None:
                if cancelled is not None and cancelled.is_set():
                    self.queue.remove(ticket)
                    raise Cancelled("the caller went away while the turn was queued")
                remaining = deadline - self.clock()
                if remaining <= 0:
                    self.queue.remove(ticket)
                    cold = ticket.host_need
                    host = f" (and {cold} host bytes for its cold tier)" if cold else ""
                    raise ResourceExhausted(
                        f"no KV room for {ticket.need} bytes{host} after waiting "
                        f"{self.config.admission_timeout_s:g} s in the admission queue; retry later"
                    )
                self._cond.wait(min(remaining, self.config.poll_interval_s, 0.25))
                self._drain()
            self._mark_admitted(ticket)
            return ticket.address

    def cancel(self, ticket: Ticket) -> None:
        """The waiter went away: leave the queue, or give back the room if already admitted."""
        with self._cond:
            self.queue.remove(ticket)
        if ticket.address is not None:
            self.release(ticket.session_id)

    def _mark_admitted(self, ticket: Ticket) -> None:  # caller holds the lock
        if ticket.address is not None:
            self._last_active[ticket.session_id] = self.clock()

    def _drain(self) -> None:  # caller holds the lock
        if self.queue.drain(self.placer):
            self._cond.notify_all()

    def release(self, session_id: str) -> str | None:
        """Forget the session's reservation (its KV is gone or being dropped)."""
        with self._cond:
            address = self.placer.location.get(session_id)
            self.placer.release(session_id)
            self._last_active.pop(session_id, None)
            self._drain()
            self._cond.notify_all()
        return address

    # -- turns and idleness ----------------------------------------------------------------------
    def begin_turn(self, session_id: str) -> None:
        with self._cond:
            if session_id in self._busy:
                raise Conflict(f"session {session_id!r} already has a turn in flight; wait for it to finish")
            self._busy.add(session_id)

    def end_turn(self, session_id: str) -> None:
        """The turn is over: its reservation goes back (the session stays where it is, idle)."""
        with self._cond:
            self._busy.discard(session_id)
            self.placer.finish(session_id)
            if session_id in self.placer.location:
                self._last_active[session_id] = self.clock()
            self._drain()
            self._cond.notify_all()

    def idle_sessions(self, ttl_s: float) -> list[tuple[str, str]]:
        """Placed sessions without a turn for ``ttl_s`` seconds (and none in flight)."""
        now = self.clock()
        with self._cond:
            return [
                (s, self.placer.location[s])
                for s, t in self._last_active.items()
                if now - t >= ttl_s and s not in self._busy and s in self.placer.location
            ]

    def reserved(self, session_id: str) -> int:
        with self._cond:
            address = self.placer.location.get(session_id)
            return self.placer.workers[address].reservations.get(session_id, 0) if address else 0

    def view(self, record: SessionRecord) -> SessionView:
        """The stored record plus what the cluster knows about it right now."""
        with self._cond:
            session_id = record.session_id
            address = self.placer.location.get(session_id, "")
            slot = self.placer.workers.get(address)
            kv = slot.reported_sessions.get(session_id, 0) if slot else 0
            reserved = slot.reservations.get(session_id, 0) if slot else 0
            if session_id in self._busy:
                state = "running" if address else "queued"
            else:
                state = "idle" if address else "released"
            return SessionView(record, state, kv, address, reserved)

    def stats(self, sessions: int) -> ClusterStats:
        with self._cond:
            workers = []
            for address in self.clients:
                slot, report = self.placer.workers.get(address), self.reports.get(address)
                if slot is None:
                    workers.append(
                        WorkerStats(address, "", False, 0, 0, 0, 0, error=self._errors.get(address, ""))
                    )
                    continue
                workers.append(
                    WorkerStats(
                        address,
                        slot.model,
                        slot.healthy,
                        slot.capacity_bytes,
                        slot.reported_used,
                        slot.reserved_bytes,
                        len(slot.reservations),
                        report.active if report else 0,
                        report.queued if report else 0,
                        "" if slot.healthy else self._errors.get(address, ""),
                    )
                )
            return ClusterStats(
                workers, sessions, len(self.placer.location), len(self.queue), self.queue.limit
            )
