"""How late the decision loop runs: a timer due every PERIOD_S, and how far past its due
time it ran.

Every engine's table is answered on one event loop. While something holds that loop (a
callback that runs long, the GIL held by another thread, a garbage collection, the
process stopped), no engine is answered, and each waits as long as the loop is late.
``nightjar_event_loop_lag_seconds`` shows such stalls from outside, whatever their cause;
the decision latency does not (it times the decisions, not the waits between them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

# The timer's period: a stall shorter than this may fall between two timers.
PERIOD_S = 0.1


class LoopLag:
    """Observes, on the loop's own thread, how late each timer ran (``observe(seconds)``)."""

    def __init__(self, observe: Callable[[float], None], period_s: float = PERIOD_S) -> None:
        self._observe = observe
        self._period_s = period_s
        self._due = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start timing ``loop`` (call on its thread); a stopped loop leaves the timer."""
        self._loop = loop
        self._schedule()

    def _schedule(self) -> None:
        assert self._loop is not None
        self._due = self._loop.time() + self._period_s
        self._loop.call_at(self._due, self._ran)

    def _ran(self) -> None:
        assert self._loop is not None
        self._observe(max(0.0, self._loop.time() - self._due))
        self._schedule()
