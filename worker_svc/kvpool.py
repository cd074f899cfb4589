"""A KV pool: reservations by owner against a fixed byte capacity (vLLM's KV-cache manager role).

The engine asks the pool, never does pool arithmetic itself. Invariant: ``sum(reserved) <=
capacity`` at all times (``reserve`` refuses, it never overcommits). Idle owners (sessions
between turns) keep a reservation equal to the bytes they still store; under pressure
``reserve`` asks the ``evict_idle`` callback to free them, least recently used first (the
callback returns the bytes the owner still holds: 0 or None when released, a residue when
demoted).

Pools are plain objects with a name so that a worker can hold more than one (a hot pool on the
accelerator and, later, a host pool for the cold tier) with the same API.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class KVPool:
    def __init__(self, name: str, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"pool {name!r}: capacity must be positive, got {capacity_bytes}")
        self.name, self.capacity_bytes = name, capacity_bytes
        self._reserved: dict[str, int] = {}

    # -- queries ---------------------------------------------------------------------------------
    @property
    def reserved_bytes(self) -> int:
        return sum(self._reserved.values())

    def reserved(self, owner: str) -> int:
        return self._reserved.get(owner, 0)

    def fits_alone(self, nbytes: int) -> bool:
        """Whether ``nbytes`` could ever be reserved (an empty pool)."""
        return nbytes <= self.capacity_bytes

    def headroom(self, owner: str = "") -> int:
        """Bytes free for ``owner`` (its own reservation counts as free for it)."""
        return self.capacity_bytes - self.reserved_bytes + self.reserved(owner)

    # -- changes -----------------------------------------------------------------------------------
    def reserve(
        self,
        owner: str,
        nbytes: int,
        idle: Iterable[str] = (),
        evict_idle: Callable[[str], int | None] | None = None,
    ) -> bool:
        """Set ``owner``'s reservation to ``nbytes`` if it fits, releasing idle owners (in the
        given order, least recently used first) through ``evict_idle`` when needed; the callback
        returns what the victim still holds (0: released; more: demoted, its reservation shrinks
        to that). When demoting them all is not enough, each is asked once more, in the same
        order (a demoted victim is then released), so one call finds the room that exists.
        Returns False (and changes nothing but the evictions it needed) when it cannot
        fit."""
        if nbytes < 0:
            raise ValueError(f"pool {self.name!r}: negative reservation {nbytes}")
        if not self.fits_alone(nbytes):
            return False
        idle = list(idle)
        for _ in range(2):  # a second round asks the demoted again (the callback then releases them)
            for victim in idle:
                if self.headroom(owner) >= nbytes:
                    break
                if victim == owner or victim not in self._reserved:
                    continue
                left = evict_idle(victim) if evict_idle is not None else 0
                self.shrink(victim, left or 0)
        if self.headroom(owner) < nbytes:
            return False
        self._reserved[owner] = nbytes
        self._check()
        return True

    def shrink(self, owner: str, nbytes: int) -> None:
        """Lower ``owner``'s reservation to what it actually stores (a finished turn)."""
        current = self._reserved.get(owner)
        if current is None:
            return
        if nbytes <= 0:
            self._reserved.pop(owner)
        else:
            self._reserved[owner] = min(current, nbytes)

    def release(self, owner: str) -> int:
        """Give back everything ``owner`` holds; returns the bytes released."""
        return self._reserved.pop(owner, 0)

    def _check(self) -> None:
        if self.reserved_bytes > self.capacity_bytes:  # a bug, never an input error
            raise RuntimeError(
                f"pool {self.name!r} overcommitted: {self.reserved_bytes} > {self.capacity_bytes}"
            )
