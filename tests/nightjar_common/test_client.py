"""The fail-open client against real sidecar processes: deadline, outages, reconnect, tables."""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from concurrent import futures
from typing import Any

import grpc
import pytest
from nightjar_proto.v1 import policy_pb2_grpc

from nightjar_common.client import ClientConfig, GammaDecision, NightjarClient, Wakeup
from nightjar_common.sidecar_stream import PendingReply
from nightjar_common.types import StepContext, StepOutcome

FALLBACK = [[1, 4, 3], [5, 16, 1]]  # default_gamma 0 above 16


def make_client(target: str, **kw: Any) -> NightjarClient:
    config = dict(target=target, engine_id="eng", fallback_schedule=FALLBACK, deadline_s=0.002)
    config.update(kw)
    return NightjarClient(ClientConfig(**config))  # type: ignore[arg-type]


def step(client: NightjarClient, index: int, batch_size: int = 2) -> GammaDecision:
    decision = client.decide(StepContext("eng", batch_size=batch_size, step_index=index))
    if decision.decision_id:
        client.report(
            StepOutcome(
                decision.decision_id, "eng", decision.gamma, 0.01, batch_size + decision.gamma
            )
        )
    return decision


def steps_while_stopped(server: Any, client: NightjarClient, indices: range) -> list[GammaDecision]:
    """The steps of ``indices`` run while the sidecar process is stopped (SIGSTOP), which
    then resumes."""
    server.proc.send_signal(signal.SIGSTOP)
    try:
        return [step(client, index) for index in indices]
    finally:
        server.proc.send_signal(signal.SIGCONT)


def wait_until(predicate: Any, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_sidecar_down_from_the_start_falls_back_to_the_table(tmp_path) -> None:
    client = make_client(f"unix:{tmp_path}/nobody.sock")
    try:
        got = [step(client, i, batch_size=b).gamma for i, b in enumerate((1, 4, 5, 16, 17, 64))]
        assert got == [3, 3, 1, 1, 0, 0]
        assert client.stats.fallbacks == {"disconnected": 6}
        assert client.stats.sidecar_decisions == 0
    finally:
        client.close()


def test_a_fresh_clients_first_decision_waits_for_the_connection(make_server) -> None:
    """The channel connects in the background: the first decision waits for it within its
    deadline instead of falling back (an engine's first steps always did)."""
    server = make_server("--policy", "static", "--params", '{"gamma": 2}')
    client = make_client(server.target, deadline_s=5.0)
    try:
        first = step(client, 0)
        assert (first.source, first.gamma) == ("sidecar", 2)
        assert client.stats.fallbacks_total == 0
    finally:
        client.close()


def test_kill_and_restart_the_sidecar(make_server) -> None:
    server = make_server()
    client = make_client(server.target, deadline_s=0.5, connect_timeout_s=5)
    try:
        assert all(step(client, i).source == "sidecar" for i in range(20))
        server.kill9()
        # An engine's steps take milliseconds: by the next one the client noticed the loss
        # (and dropped the sidecar's decision table: a restarted sidecar does not know it).
        time.sleep(0.2)
        # Decisions keep coming (from the fallback) while the sidecar is gone.
        outage = [step(client, 100 + i) for i in range(20)]
        assert all(d.source == "fallback" for d in outage[1:])
        assert client.stats.fallbacks_total >= 19
        server.start()
        assert wait_until(lambda: step(client, 500).source == "sidecar")
        assert all(step(client, 600 + i).source == "sidecar" for i in range(20))
        assert client.stats.reconnects >= 1
        client.flush()  # outcomes go in batches
        # Outcomes flow to the new process again.
        assert wait_until(lambda: server.state()["reports"] >= 19)
    finally:
        client.close()


def test_a_stalled_sidecar_leaves_the_held_table_until_it_expires(make_server) -> None:
    """With decision tables a stalled sidecar costs nothing while the held table is valid
    (64 steps, 1 s), then each step waits at most the deadline and falls back — for the
    one table request in flight, not a new request each (they would pile up)."""
    for attempt in range(3):
        server = make_server(name=f"stall{attempt}")  # (a fresh policy: not exploring)
        client = make_client(server.target, deadline_s=0.005, connect_timeout_s=5)
        try:
            assert wait_until(lambda c=client: step(c, 0).source == "sidecar")
            asked, tables = client.stats.miss_requests, client.stats.tables
            stalled = steps_while_stopped(server, client, range(1, 81))
            # A table that came during the stall was sent before it (the refresh behind a
            # first miss answered late, read late on a busy host): stall another sidecar.
            if client.stats.tables != tables:
                continue
            sources = [d.source for d in stalled]
            answered = sources.index("fallback")
            assert 0 < answered < 64 and set(sources[answered:]) == {"fallback"}
            # Its 64 steps used up (or its second gone), with the refresh unanswered.
            misses = client.stats.table_misses
            assert sum(n for why, n in misses.items() if why.startswith(("used_up", "expired")))
            assert client.stats.fallbacks["deadline"] >= 80 - 64
            assert client.stats.miss_requests - asked == 1
            assert wait_until(lambda c=client: step(c, 200).source == "sidecar")
            return
        finally:
            client.close()
    pytest.fail("each stall overlapped a reply the sidecar had sent before it")


def test_a_miss_answered_late_leaves_one_refresh_behind_it(make_server) -> None:
    """Steps after a miss whose table is late wait for that table and ask once for the
    next step's table behind it, not once each (under overload the second table lowers
    the fallbacks: docs/DECISION_TABLES.md)."""
    server = make_server()
    client = make_client(
        server.target, deadline_s=0.005, connect_timeout_s=5, table_refresh_ms=60_000.0
    )
    try:
        assert wait_until(lambda: client.connected)
        late = steps_while_stopped(server, client, range(5))
        assert {d.source for d in late} == {"fallback"}
        assert wait_until(lambda: step(client, 5).source == "sidecar")
        assert client.stats.miss_requests == 1
        assert client.stats.refresh_requests == 1
    finally:
        client.close()


def test_rejected_context_falls_back_with_a_reason(make_server) -> None:
    server = make_server()
    client = make_client(server.target, deadline_s=0.5, connect_timeout_s=5)
    try:
        bad = client.decide(StepContext("eng", batch_size=2, free_kv_blocks=10, total_kv_blocks=5))
        assert (bad.source, bad.fallback_reason) == ("fallback", "rejected")
        assert client.decide(StepContext("eng", batch_size=2)).source == "sidecar"
    finally:
        client.close()


class _StreamsThatEndAtOnce(policy_pb2_grpc.PolicyServiceServicer):
    """A sidecar whose first streams end as soon as they open (one still starting up, or
    going away); the stream after those is held open."""

    def __init__(self, failing: int) -> None:
        self.failing = failing
        self.opened = 0

    def StepStream(self, request_iterator: Any, context: Any) -> Any:
        self.opened += 1
        if self.opened > self.failing:
            for _ in request_iterator:
                pass
        yield from ()


class _SlowLogSink(logging.Handler):
    """A log sink that takes its time (a remote collector, a full pipe) over the reconnect
    thread's lines; the stream reader's own warning goes through at once, so that the
    stream's end lands while the reconnect thread is still logging."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.threadName == "nightjar-reconnect":
            time.sleep(0.1)


def test_a_stream_that_ends_at_once_is_reopened_even_behind_a_slow_log(tmp_path) -> None:
    # Regression: the reconnect loop used to log the (re)connection and only then clear its
    # "broken" flag, so a stream that ended during the log call was forgotten and the client
    # stayed on the fallback table for good (seen once in CI after a sidecar restart).
    servicer = _StreamsThatEndAtOnce(failing=3)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    policy_pb2_grpc.add_PolicyServiceServicer_to_server(servicer, server)
    target = f"unix:{tmp_path}/flaky.sock"
    server.add_insecure_port(target)
    server.start()
    sink = _SlowLogSink()
    client_log = logging.getLogger("nightjar_common.sidecar_connection")
    client_log.addHandler(sink)
    level = client_log.level
    client_log.setLevel(logging.INFO)  # the connection lines are INFO
    client = make_client(target, connect_timeout_s=0)
    try:
        assert wait_until(lambda: client.connected)
        time.sleep(0.3)
        assert client.connected and servicer.opened == 4
        assert client.stats.reconnects == 3
    finally:
        client.close()
        client_log.removeHandler(sink)
        client_log.setLevel(level)
        server.stop(grace=None)


def test_the_sender_wakeup_is_an_event_that_clears_as_it_wakes() -> None:
    """Set before the wait: it wakes at once, and several sets wake it once; set from
    another thread: it wakes; unset: the wait times out."""
    wakeup = Wakeup()
    assert not wakeup.wait(timeout=0.01)
    wakeup.set()
    wakeup.set()
    assert wakeup.wait(timeout=0.01)
    assert not wakeup.wait(timeout=0.01)  # both sets answered by one wake-up
    timer = threading.Timer(0.05, wakeup.set)
    timer.start()
    started = time.monotonic()
    assert wakeup.wait(timeout=5)
    assert time.monotonic() - started < 2
    timer.join()


def test_a_reply_wakes_its_waiter_after_its_callbacks_ran() -> None:
    """What a callback installs (a table) is there when the waiter wakes: the waiter does
    not install it again itself."""
    pending = PendingReply()
    installed: list[str] = []
    pending.add_done_callback(lambda done: (time.sleep(0.05), installed.append("table")))
    relayed = PendingReply()
    pending.relay_to(relayed)
    resolver = threading.Timer(0.01, pending.resolve, kwargs={"error": ConnectionError("x")})
    resolver.start()
    with pytest.raises(ConnectionError):
        relayed.result(timeout=5)
    assert installed == ["table"]
    resolver.join()


def test_a_step_the_table_cannot_answer_is_sent_by_the_sender_thread(make_server) -> None:
    """The engine's thread hands a miss to the sender thread, which gathers the deferred
    reports and sends them with the step's table request; the sidecar commits them."""
    server = make_server()
    client = make_client(server.target, deadline_s=0.5, connect_timeout_s=5)
    gathered_on: list[str] = []

    class Deferred:
        def settle(self) -> None:
            gathered_on.append(threading.current_thread().name)

    client.defer_reports_to(Deferred())
    try:
        first = step(client, 0)  # its step and outcome are queued for the next request
        assert first.source == "sidecar" and first.table_step is not None
        gathered_on.clear()
        asked = client.stats.miss_requests
        far = client.decide(StepContext("eng", batch_size=60, step_index=1))  # off the table
        assert far.source == "sidecar" and client.stats.table_misses["batch_size"] == 1
        assert client.stats.miss_requests - asked == 1
        assert gathered_on and threading.current_thread().name not in gathered_on
        assert "nightjar-tables" in gathered_on
        assert wait_until(lambda: server.state()["reports"] == 1)
    finally:
        client.close()


def test_a_replay_ages_its_tables_on_the_simulated_clock(make_server) -> None:
    """A replay's tables are refreshed by the simulated time each step gives, not by the
    wall clock: wall time passing refreshes nothing, 200 simulated ms do (a step ahead),
    and a table past its valid_ms of simulated time serves no step."""
    server = make_server("--policy", "static", "--params", '{"gamma": 2}')
    client = make_client(server.target, deadline_s=10.0, connect_timeout_s=10, replay=True)
    try:
        ctx = StepContext("eng", batch_size=4, step_index=0, previous_gamma=2)

        def decide(index: int, now_s: float) -> GammaDecision:
            return client.decide(dataclasses.replace(ctx, step_index=index), now_s)

        assert decide(0, 0.0).source == "sidecar"
        tables = client.stats.tables
        time.sleep(0.3)  # longer than the refresh period on the wall clock
        decide(1, 0.01)
        assert client.stats.tables == tables  # the same table serves
        decide(2, 0.2)  # 200 simulated ms old: refreshed ahead of the next step
        assert client.stats.tables == tables + 1
        taken = decide(3, 0.21).table_step
        assert taken is not None and taken.use == 1  # the new table's first step
        # It started at 0.21 s; past its valid_ms (1 s) of simulated time it serves no
        # step: the step misses and asks, and is still answered by the sidecar.
        assert not client.stats.table_misses["expired"]
        assert decide(4, 1.3).source == "sidecar"
        assert client.stats.table_misses["expired"] == 1
        assert client.stats.fallbacks_total == 0
    finally:
        client.close()


def test_flushes_racing_for_the_same_reports_send_no_empty_request(make_server) -> None:
    """Threads flushing at once (the engine's idle flush, the sender's batch-full flush):
    one takes the queued outcome, the others send nothing, so the sidecar rejects no
    empty report batch and commits every outcome once. The deferred reports take a while
    to settle (as the plugin's journal does), which lets the threads interleave."""
    server = make_server()
    client = make_client(server.target, deadline_s=0.5, connect_timeout_s=5)
    rounds, flushers = 20, 4

    class SlowToSettle:
        def settle(self) -> None:
            time.sleep(0.002)

    client.defer_reports_to(SlowToSettle())
    try:
        for index in range(rounds):
            step(client, index)  # one table-answered step and its outcome queued
            barrier = threading.Barrier(flushers)

            def flush(barrier: threading.Barrier) -> None:
                barrier.wait()
                client.flush()

            threads = [threading.Thread(target=flush, args=(barrier,)) for _ in range(flushers)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        assert wait_until(lambda: server.state()["reports"] == rounds)
        time.sleep(0.2)  # any late reply to an empty batch would have arrived
        assert client.stats.rejected_reports == 0
    finally:
        client.close()


def test_a_reply_held_up_is_counted_slow_with_how_long_it_waited(make_server) -> None:
    """A table request the stopped sidecar answers 0.3 s late: the step that asked fell
    back at its deadline, and the reply, when it came, is counted slow with its wait (what
    tells a run of fallbacks on a stalled sidecar or stream from one on a slow policy)."""
    server = make_server()
    client = make_client(
        server.target, deadline_s=0.005, connect_timeout_s=5, table_refresh_ms=60_000.0
    )
    try:
        assert wait_until(lambda: client.connected)
        assert wait_until(lambda: step(client, 0).source == "sidecar")
        assert client.stats.slow_replies == 0 and client.stats.longest_reply_s < 0.1
        server.proc.send_signal(signal.SIGSTOP)
        try:
            assert step(client, 1, batch_size=60).source == "fallback"  # a miss: it asked
            time.sleep(0.3)
        finally:
            server.proc.send_signal(signal.SIGCONT)
        # The miss's request, and the refresh for the step after it asked behind it.
        assert wait_until(lambda: client.stats.slow_replies >= 1), client.stats
        assert client.stats.slow_replies <= 2
        assert 0.3 <= client.stats.longest_reply_s < 5
    finally:
        client.close()
