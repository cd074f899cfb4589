"""Domain errors of the scheduler. The gRPC layer maps each class to one status code."""

from __future__ import annotations


class SchedulerError(Exception):
    """Base class; ``code`` names the gRPC status the servicer reports."""

    code = "INTERNAL"


class InvalidArgument(SchedulerError, ValueError):
    code = "INVALID_ARGUMENT"


class NotFound(SchedulerError, KeyError):
    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "not found"


class ResourceExhausted(SchedulerError):
    """The pool is full and the admission queue too, or a session can never fit."""

    code = "RESOURCE_EXHAUSTED"


class Unavailable(SchedulerError):
    """A dependency (Redis, every worker of a model) is unreachable; retrying later may work."""

    code = "UNAVAILABLE"


class StoreUnavailable(Unavailable):
    """The session store (Redis) cannot be reached."""


class WorkerUnavailable(Unavailable):
    """A worker did not answer (dead, restarting, network)."""


class TurnFailed(Unavailable):
    """The worker failed this one turn (its INTERNAL) but is itself healthy: not marked down."""


class Cancelled(SchedulerError):
    """The caller went away (cancelled or deadline) before the turn ran."""

    code = "CANCELLED"


class WorkerRefused(SchedulerError):
    """A worker refused a session because its own KV pool is full (its RESOURCE_EXHAUSTED)."""

    code = "RESOURCE_EXHAUSTED"


class Conflict(SchedulerError):
    """Another turn of the same session is in flight, or the stored transcript moved on."""

    code = "FAILED_PRECONDITION"
