"""A turn's blocking work on its own thread, its events handed to the asyncio event loop.

The scheduler's core is synchronous (a generator fed by a gRPC stream from the worker). Each
call gets one thread that runs it and posts every event to an ``asyncio.Queue``; the request
handler awaits the queue. ``cancel()`` (the client went away) sets the turn's ``cancelled``
event and wakes the admission queue, so a queued turn leaves at once and a running one is closed
(cancelled on the worker, nothing recorded) at its next token.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from scheduler_svc.http.errors import ApiError

log = logging.getLogger("confkv.http")
Work = Callable[[Callable[[object], None], threading.Event], None]


class Finished:
    """Posted after the work returned (the last item of every pump)."""


FINISHED = Finished()


class TurnPump:
    def __init__(self, wake: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._wake = wake
        self.gone = threading.Event()
        self.finished = False

    def start(self, work: Work) -> None:
        threading.Thread(target=self._run, args=(work,), name="http-turn", daemon=True).start()

    def _run(self, work: Work) -> None:
        try:
            work(self._post, self.gone)
        except ApiError as err:
            self._post(err)
        except Exception:
            log.exception("chat completion failed")
            self._post(ApiError(500, "internal error (logged on the server)", code="internal_error"))
        self._post(FINISHED)

    def _post(self, item: object) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.gone.set()

    async def get(self) -> object:
        """The next item: a domain event, an ``ApiError`` (raised here) or ``FINISHED``."""
        item = await self._queue.get()
        if isinstance(item, Finished):
            self.finished = True
        if isinstance(item, ApiError):
            raise item
        return item

    def cancel(self) -> None:
        """The caller went away: stop the turn (a no-op once it finished)."""
        if not self.finished and not self.gone.is_set():
            self.gone.set()
            self._wake()
