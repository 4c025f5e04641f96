"""The decision loop's lag: a stall of the loop is measured, in process and in a served sidecar."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from policy_server.loop_lag import LoopLag


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


def _lag_above(server: Any, bound: str) -> float:
    """Timers of the served sidecar's loop that ran more than ``bound`` seconds late."""
    body = urllib.request.urlopen(
        f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5
    ).read()
    found = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == "nightjar_event_loop_lag_seconds_count":
                found["count"] = sample.value
            elif sample.name == "nightjar_event_loop_lag_seconds_bucket":
                found[sample.labels["le"]] = sample.value
    return found["count"] - found[bound]


def test_a_stopped_sidecar_shows_its_loop_late_by_the_stop(make_server: Any) -> None:
    server = make_server()
    # Its start-up over (the heap frozen once the listeners are up may hold the loop).
    before, deadline = _lag_above(server, "0.002"), time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.5)
        if (now := _lag_above(server, "0.002")) == before:
            break
        before = now
    before = _lag_above(server, "0.25")
    server.proc.send_signal(signal.SIGSTOP)
    time.sleep(0.5)
    server.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 5
    while _lag_above(server, "0.25") == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _lag_above(server, "0.25") == before + 1
