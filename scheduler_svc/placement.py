"""Placement and admission by KV footprint.

The scheduler never sees tensors: only workers' reported bytes and capacities, and each
session's worst-case KV bytes (its *reservation*). A reservation is held only while a turn
runs: an idle session keeps its *location* (the worker holding its KV copy) but no reservation,
because the worker frees idle KV under pressure (least recently used first) and can rebuild it
from the transcript. A turn is admitted on a worker only when its reservation fits next to every
running turn's there plus any bytes the worker reports for sessions this scheduler does not
know; so no worker's reported bytes can exceed its capacity. ``admit`` returns ``None`` when
nothing fits (like vLLM's ``allocate_slots``); the caller then waits in a bounded FIFO
``AdmissionQueue``. A session's current worker is preferred (its KV is warm there).

Sessions with a cold tier (``recall=1``) also need host memory on the worker (its
``--host-pool-bytes``): a turn's worst-case cold bytes (``host_need``) are reserved the same way
against the worker's reported host pool, so placement never sends a recall session where its cold
tier cannot fit. A worker that reports no host capacity has no host limit.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from confkv.memory import KVGeometry
from confkv.policies import CachePolicy
from scheduler_svc.domain import WorkerReport, WorkerStats
from scheduler_svc.errors import ResourceExhausted


def reservation_bytes(policy: CachePolicy, geometry: KVGeometry, max_context: int) -> int:
    """Worst-case KV bytes of one session: its policy's peak bound for this model, never more
    than a full cache of ``max_context`` tokens (which is what a ``full`` session may grow to)."""
    return policy.worst_case_bytes(geometry, max_context)


@dataclass
class WorkerSlot:
    """The scheduler's view of one worker."""

    address: str
    model: str
    capacity_bytes: int
    reported_used: int = 0
    reported_sessions: dict[str, int] = field(default_factory=dict)
    reservations: dict[str, int] = field(default_factory=dict)
    healthy: bool = True
    host_capacity_bytes: int = 0  # 0: no host limit
    host_reported_used: int = 0
    reported_cold: dict[str, int] = field(default_factory=dict)
    host_reservations: dict[str, int] = field(default_factory=dict)

    @property
    def reserved_bytes(self) -> int:
        return sum(self.reservations.values())

    located: set[str] = field(default_factory=set)  # sessions whose KV copy lives here

    @property
    def external_bytes(self) -> int:
        """Reported bytes of sessions this scheduler did not place here (orphans not yet
        reconciled away); counted so they are never double-booked. Idle sessions of ours are
        not counted: the worker frees them when a turn needs the room."""
        known = sum(b for s, b in self.reported_sessions.items() if s in self.located)
        return max(0, self.reported_used - known)

    @property
    def committed_bytes(self) -> int:
        return self.reserved_bytes + self.external_bytes

    @property
    def host_committed_bytes(self) -> int:
        """Host bytes reserved for running turns plus cold bytes of sessions placed elsewhere (as
        for hot bytes, idle sessions of ours are not counted: the worker frees them for room)."""
        known = sum(b for s, b in self.reported_cold.items() if s in self.located)
        return sum(self.host_reservations.values()) + max(0, self.host_reported_used - known)

    def fits(self, need: int, host_need: int = 0) -> bool:
        if not self.healthy or self.committed_bytes + need > self.capacity_bytes:
            return False
        return (
            not host_need
            or not self.host_capacity_bytes
            or (self.host_committed_bytes + host_need <= self.host_capacity_bytes)
        )

    def stats(self) -> WorkerStats:
        return WorkerStats(
            self.address,
            self.model,
            self.healthy,
            self.capacity_bytes,
            self.reported_used,
            self.reserved_bytes,
            len(self.reservations),
        )


class Placer:
    """Reservations per worker. Not thread-safe: the scheduler core holds its lock around it."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerSlot] = {}
        self.location: dict[str, str] = {}  # session id -> worker address

    def update(self, report: WorkerReport) -> None:
        slot = self.workers.get(report.address)
        if slot is None:
            slot = self.workers[report.address] = WorkerSlot(report.address, report.model, 0)
        slot.model = report.model
        slot.capacity_bytes = report.capacity_bytes
        slot.reported_used = report.used_bytes
        slot.reported_sessions = dict(report.session_bytes)
        slot.host_capacity_bytes = report.host_capacity_bytes
        slot.host_reported_used = report.host_used_bytes
        slot.reported_cold = dict(report.session_cold_bytes)
        slot.healthy = True

    def mark_down(self, address: str) -> list[str]:
        """A worker stopped answering: its sessions lose their KV; returns their ids."""
        slot = self.workers.get(address)
        if slot is None:
            return []
        slot.healthy = False
        lost = sorted(slot.located | set(slot.reservations))
        for session_id in lost:
            self.release(session_id)
        slot.reported_used, slot.reported_sessions = 0, {}
        slot.host_reported_used, slot.reported_cold = 0, {}
        return lost

    def largest_capacity(self, model: str) -> int:
        return max((w.capacity_bytes for w in self.workers.values() if w.model == model), default=0)

    def largest_host_capacity(self, model: str) -> int | None:
        """The largest host pool among the model's workers; None when one has no host limit."""
        caps = [w.host_capacity_bytes for w in self.workers.values() if w.model == model]
        return None if not caps or 0 in caps else max(caps)

    def serves(self, model: str, healthy_only: bool = False) -> bool:
        return any(w.model == model and (w.healthy or not healthy_only) for w in self.workers.values())

    def admit(
        self,
        session_id: str,
        model: str,
        need: int,
        exclude: frozenset[str] = frozenset(),
        host_need: int = 0,
    ) -> str | None:
        """Reserve ``need`` bytes (and ``host_need`` host bytes for a cold tier) for a turn: on
        the session's current worker if it fits there, else on the worker with the most
        headroom; None when none fits."""
        current = self.location.get(session_id)
        if current is not None and session_id in self.workers[current].reservations:
            return current
        fitting = [
            w
            for w in self.workers.values()
            if w.model == model and w.address not in exclude and w.fits(need, host_need)
        ]
        if not fitting:
            return None
        here = next((w for w in fitting if w.address == current), None)
        best = here or max(
            fitting, key=lambda w: (w.capacity_bytes - w.committed_bytes, -len(w.reservations))
        )
        self.adopt(session_id, best.address, need, host_need)
        return best.address

    def adopt(self, session_id: str, address: str, need: int, host_need: int = 0) -> None:
        """Record a running turn's reservation on ``address`` (the session now lives there)."""
        if self.location.get(session_id) != address:
            self.release(session_id)
        slot = self.workers[address]
        slot.reservations[session_id] = need
        if host_need:
            slot.host_reservations[session_id] = host_need
        slot.located.add(session_id)
        self.location[session_id] = address

    def finish(self, session_id: str) -> int:
        """The turn ended: give back its reservation; the session stays located (idle)."""
        address = self.location.get(session_id)
        if not address:
            return 0
        self.workers[address].host_reservations.pop(session_id, None)
        return self.workers[address].reservations.pop(session_id, 0)

    def release(self, session_id: str) -> int:
        """The session's KV is gone (or being dropped): no location, no reservation."""
        address = self.location.pop(session_id, None)
        if address is None:
            return 0
        slot = self.workers[address]
        slot.located.discard(session_id)
        slot.reported_sessions.pop(session_id, None)  # its bytes are gone with the session
        slot.reported_cold.pop(session_id, None)
        slot.host_reservations.pop(session_id, None)
        return slot.reservations.pop(session_id, 0)

    def strays(self, address: str) -> list[str]:
        """Sessions the worker reports that this scheduler has not placed there: to be dropped
        (a worker back from a blip, a scheduler restart). Redis is the truth, not the worker."""
        slot = self.workers.get(address)
        if slot is None or not slot.healthy:
            return []
        return sorted(s for s in slot.reported_sessions if s not in slot.located)


@dataclass
class Ticket:
    """One waiting placement request. ``address`` is set when it is admitted."""

    session_id: str
    model: str
    need: int
    seq: int
    address: str | None = None
    exclude: frozenset[str] = frozenset()
    host_need: int = 0


class AdmissionQueue:
    """Bounded FIFO of waiting placements. Fair: within a model, nobody is admitted ahead of an
    earlier waiter; a head that does not fit only blocks its own model's lane."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"queue limit must be >= 0, got {limit}")
        self.limit = limit
        self._waiting: OrderedDict[int, Ticket] = OrderedDict()
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._waiting)

    def push(
        self,
        session_id: str,
        model: str,
        need: int,
        exclude: frozenset[str] = frozenset(),
        host_need: int = 0,
    ) -> Ticket:
        if len(self._waiting) >= self.limit:
            raise ResourceExhausted(
                f"KV pool full and the admission queue is full ({self.limit} waiting); retry later"
            )
        ticket = Ticket(session_id, model, need, next(self._seq), exclude=exclude, host_need=host_need)
        self._waiting[ticket.seq] = ticket
        return ticket

    def remove(self, ticket: Ticket) -> None:
        self._waiting.pop(ticket.seq, None)

    def position(self, ticket: Ticket) -> int:
        """1-based place among waiters of the same model (0 = not waiting)."""
        ahead = [t.seq for t in self._waiting.values() if t.model == ticket.model]
        return ahead.index(ticket.seq) + 1 if ticket.seq in ahead else 0

    def drain(self, placer: Placer) -> list[Ticket]:
        """Admit waiters in order while they fit; returns the admitted tickets."""
        admitted: list[Ticket] = []
        blocked: set[str] = set()
        for ticket in list(self._waiting.values()):
            if ticket.model in blocked:
                continue
            address = placer.admit(
                ticket.session_id, ticket.model, ticket.need, ticket.exclude, ticket.host_need
            )
            if address is None:
                blocked.add(ticket.model)
                continue
            ticket.address = address
            self._waiting.pop(ticket.seq)
            admitted.append(ticket)
        return admitted
