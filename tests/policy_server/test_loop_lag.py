"""The decision loop's lag: a stall of the loop is measured, in process and in a served sidecar."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from typing import Any

from policy_server.loop_lag import LoopLag
from tests.rigs.sidecar import loop_lag_above, wait_for_quiet_loop


def test_a_callback_that_holds_the_loop_is_measured_as_lag() -> None:
    loop = asyncio.new_event_loop()
    lags: list[float] = []
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        loop.call_soon_threadsafe(LoopLag(lags.append, period_s=0.01).start, loop)
        time.sleep(0.1)
        loop.call_soon_threadsafe(time.sleep, 0.2)  # a callback that holds the loop
        time.sleep(0.4)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        loop.close()
    assert len(lags) >= 10  # a timer every 10 ms, running again after each
    late = [lag for lag in lags if lag > 0.05]
    assert len(late) == 1 and 0.15 < late[0] < 0.3, lags


def test_a_stopped_sidecar_shows_its_loop_late_by_the_stop(make_server: Any) -> None:
    server = make_server()
    wait_for_quiet_loop(server.metrics_port)
    before = loop_lag_above(server.metrics_port, "0.25")
    server.proc.send_signal(signal.SIGSTOP)
    time.sleep(0.5)
    server.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 5
    while loop_lag_above(server.metrics_port, "0.25") == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loop_lag_above(server.metrics_port, "0.25") == before + 1
