"""Engines' streams are bounded (issue 54 finding 10): past max_streams a new stream is
refused with RESOURCE_EXHAUSTED and counted; a stream that sends nothing for
stream_idle_timeout_s is closed with UNAVAILABLE, marked idle, and the plugin's connection
opens a new one quietly: no warning, no lost tables, no reconnect counted."""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from typing import Any

import grpc
import pytest
from nightjar_proto.v1 import policy_pb2
from prometheus_client.parser import text_string_to_metric_families

from nightjar_common.sidecar_connection import SidecarConnection
from nightjar_common.sidecar_stream import StepStream, StreamEnded, SyncStream
from tests.policy_server.test_server import context


def metric(server: Any, name: str) -> float:
    body = urllib.request.urlopen(
        f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5
    ).read()
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise KeyError(name)


def wait_for(condition: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"still not {what} after {timeout} s")
        time.sleep(0.05)


def step(seq: int = 0) -> policy_pb2.StepRequest:
    return policy_pb2.StepRequest(seq=seq, context=context())


def answered_on(connection: SidecarConnection) -> policy_pb2.StepReply:
    """A request's reply on the connection's live stream; sent again on the next stream
    when the one it went on was closed idle as it was sent (0.5 s idle timeouts here)."""
    for attempt in range(5):
        stream = connection.live(0)
        if stream is not None:
            try:
                return stream.send(step(attempt + 1)).result(10)
            except StreamEnded as ended:
                if not ended.idle:
                    raise
        time.sleep(0.05)
    raise AssertionError("no stream answered")


def test_streams_past_the_cap_are_refused_and_counted(make_server: Any) -> None:
    server = make_server("--max-streams", "2")
    first, second = server.engine(), server.engine()
    for engine in (first, second):
        assert engine.send(step()).HasField("table")  # both are open on the sidecar
    assert metric(server, "nightjar_streams_open") == 2
    with SyncStream(server.channel) as third, pytest.raises(StreamEnded) as info:
        third.send(step())
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "2 streams are open, the most this sidecar serves (max_streams" in info.value.details
    assert metric(server, "nightjar_streams_refused_total") == 1
    # The open ones are served on, and a closed one's place is taken by a new stream.
    assert second.send(step()).HasField("table")
    first.close()
    wait_for(lambda: metric(server, "nightjar_streams_open") == 1, "down to one stream")
    with SyncStream(server.channel) as fourth:
        assert fourth.send(step()).HasField("table")
    second.close()


def test_an_idle_stream_is_closed_marked_idle(make_server: Any) -> None:
    server = make_server("--stream-idle-timeout-s", "0.5")
    ended = threading.Event()
    stream = StepStream(server.channel, lambda _: ended.set(), lambda version: None)
    try:  # it sends nothing at all
        assert ended.wait(30), "the idle stream was not closed"
        why = stream.ended
        assert why is not None and why.idle
        assert why.code == grpc.StatusCode.UNAVAILABLE
        assert "no request for 0.5 s (stream_idle_timeout_s" in why.details
        assert metric(server, "nightjar_streams_idle_closed_total") >= 1
        assert metric(server, "nightjar_streams_open") == 0
    finally:
        stream.close()


def test_the_plugin_reopens_an_idle_stream_quietly(
    make_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server = make_server("--stream-idle-timeout-s", "0.5")
    caplog.set_level(logging.DEBUG, logger="nightjar_common.sidecar_connection")
    opened: list[bool] = []
    lost: list[bool] = []
    connection = SidecarConnection(
        server.target, None, opened.append, lambda: lost.append(True), lambda version: None
    )
    try:
        assert connection.wait_connected(10)
        first = connection.live(0)
        assert first is not None
        wait_for(
            lambda: (
                metric(server, "nightjar_streams_idle_closed_total") >= 1
                and connection.live(0) not in (None, first)
            ),
            "reopened after an idle close",
        )
        assert answered_on(connection).HasField("table")
        assert (opened, lost, connection.reconnects) == ([False], [], 0)
        warnings = [
            r
            for r in caplog.records
            if r.name == "nightjar_common.sidecar_connection" and r.levelno >= logging.WARNING
        ]
        assert warnings == []
        assert "closed the idle stream" in caplog.text
    finally:
        connection.close()
