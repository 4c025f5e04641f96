"""Connection supervision: keep one live ``StepStream`` to the sidecar, reopen it with
backoff after the sidecar goes away, and say once, at start, why it cannot be reached.

The owner learns of the connection's life through two callbacks run on the connection's
thread: ``on_open(reconnected)`` when a stream is up, ``on_lost()`` when it broke.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

import grpc

from nightjar_common import uds
from nightjar_common.sidecar_stream import StepStream
from nightjar_common.tls import ClientTls, open_channel

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    # Reconnect quickly after a sidecar restart (gRPC's default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
]
# grpc.channel_ready_future's poller wakes up this often (grpc/_channel.py), plus margin.
POLLER_PERIOD_S = 0.25
# A sidecar that accepts connections but gives no gRPC answer for this long is reported.
UNREADY_WARNING_S = 2.0
# The wait between attempts to open a stream: doubles from the first to the last.
FIRST_BACKOFF_S = 0.05
LAST_BACKOFF_S = 1.0
# What an operator should check, by the error connecting to the sidecar's address.
_HINTS = {
    PermissionError: "the engine's user needs write access to the socket: run it in the "
    "socket's group (the sidecar creates it with mode 0660; Kubernetes: fsGroup)",
    FileNotFoundError: "no socket there: is the sidecar running, and does the engine "
    "mount the sidecar's socket directory?",
    ConnectionRefusedError: "nothing listens there (a stopped sidecar's socket, or the wrong port)",
}


class SidecarConnection:
    """One channel to ``target`` and the stream open on it, supervised by a thread."""

    def __init__(
        self,
        target: str,
        tls: ClientTls | None,
        on_open: Callable[[bool], None],
        on_lost: Callable[[], None],
        on_notice: Callable[[str], None],
    ) -> None:
        self.target = target
        self._tls = tls
        self._on_open = on_open
        self._on_lost = on_lost
        self._on_notice = on_notice
        self.reconnects = 0
        self._stream: StepStream | None = None
        self._closed = threading.Event()
        self._broken = threading.Event()
        # The sidecar closed the last stream for being idle: the next is opened quietly,
        # and the owner keeps its tables (the same sidecar still holds them).
        self._idle_closed = False
        # Start-up diagnostics: one warning while the sidecar cannot be reached, one line
        # when it first answers.
        self._started = time.monotonic()
        self._warned_unreachable = False
        self._ready_wait_ended = 0.0
        # Set once the first stream is up. The first request of a fresh client waits for
        # it, within its deadline (the channel connects in the background: without the
        # wait an engine's first decisions always fell back); later ones never wait.
        self._first_open = threading.Event()
        self._waited_for_first = False
        # TLS is the channel's business: calls over it are the same as over plaintext.
        self._channel = open_channel(target, tls, CHANNEL_OPTIONS)
        self._supervisor = threading.Thread(
            target=self._supervise, name="nightjar-reconnect", daemon=True
        )
        self._broken.set()
        self._supervisor.start()

    @property
    def connected(self) -> bool:
        stream = self._stream
        return stream is not None and stream.alive

    def wait_connected(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.connected:
                return True
            time.sleep(0.01)
        return self.connected

    def live(self, first_wait_s: float) -> StepStream | None:
        """The stream to send on, if it is up (the first call of a fresh connection waits
        ``first_wait_s`` for it)."""
        stream = self._stream
        if stream is None and not self._waited_for_first:
            self._waited_for_first = True
            self._first_open.wait(first_wait_s)
            stream = self._stream
        return stream if stream is not None and stream.alive else None

    def close(self) -> None:
        self._closed.set()
        self._broken.set()
        if self._stream is not None:
            self._stream.close()
        self._supervisor.join(timeout=2)
        # gRPC's connectivity poller notices within one poll period (0.2 s) that the last
        # subscriber left; closing the channel under it makes it raise in its thread.
        linger = self._ready_wait_ended + POLLER_PERIOD_S - time.monotonic()
        if linger > 0:
            time.sleep(linger)
        self._channel.close()

    def _stream_broken(self, stream: StepStream) -> None:
        ended = stream.ended
        if ended is not None and ended.idle:
            log.debug("the sidecar closed the idle stream; opening a new one")
            self._idle_closed = True
        else:
            if not self._closed.is_set():
                log.warning("lost the sidecar stream; falling back and reconnecting")
            self._on_lost()
        self._broken.set()

    def _supervise(self) -> None:
        """Keep one live stream; reopen it with backoff whenever it breaks."""
        backoff = FIRST_BACKOFF_S
        while not self._closed.is_set():
            self._broken.wait()
            if self._closed.is_set():
                return
            ready = grpc.channel_ready_future(self._channel)
            try:
                ready.result(timeout=backoff)
            except grpc.FutureTimeoutError:
                # Unsubscribe: a pending future keeps gRPC's connectivity poller running,
                # which then races the channel's close.
                ready.cancel()
                self._ready_wait_ended = time.monotonic()
                if self._stream is None:
                    self._warn_unreachable()
                backoff = min(backoff * 2, LAST_BACKOFF_S)
                continue
            # Cleared before the new stream exists: a stream that breaks at once (a
            # sidecar still starting, or the channel's READY left over from before a kill)
            # sets it again, and is reopened instead of being lost.
            self._broken.clear()
            stream = StepStream(self._channel, self._stream_broken, self._on_notice)
            reconnected = self._stream is not None
            if self._idle_closed:  # a normal end: no reconnect to count or tell the owner
                self._idle_closed = False
                self._stream = stream
                backoff = FIRST_BACKOFF_S
                continue
            if reconnected:
                self.reconnects += 1
                log.info("nightjar: reconnected to the sidecar at %s", self.target)
            else:
                self._log_first_connection()
            self._on_open(reconnected)
            self._stream = stream
            self._first_open.set()
            backoff = FIRST_BACKOFF_S

    def _warn_unreachable(self) -> None:
        """Once, at start: why the sidecar cannot be reached (the engine meanwhile runs on
        the fallback table, which is easy to miss: it still serves)."""
        if self._warned_unreachable:
            return
        error = connect_error(self.target)
        if error is None and time.monotonic() - self._started < UNREADY_WARNING_S:
            return  # it accepts connections: give gRPC a moment before complaining
        self._warned_unreachable = True
        if error is None:
            reason = f"it accepts connections but gave no gRPC answer in {UNREADY_WARNING_S} s"
            if self._tls is not None:
                # A refused handshake looks just like this from here.
                reason += (
                    " (with TLS: does the sidecar serve TLS, does its certificate chain "
                    "to NIGHTJAR_TLS_CA and name the target or NIGHTJAR_TLS_SERVER_NAME, "
                    "and with mutual TLS does NIGHTJAR_TLS_CERT chain to its client CA?)"
                )
        else:
            hint = next((h for kind, h in _HINTS.items() if isinstance(error, kind)), "")
            reason = f"{error}" + (f" ({hint})" if hint else "")
        log.warning(
            "nightjar: cannot connect to the sidecar at %s: %s. Until it answers, "
            "γ comes from the local fallback table; retrying in the background.",
            self.target,
            reason,
        )

    def _log_first_connection(self) -> None:
        waited = time.monotonic() - self._started
        # As loud as the warning it ends, so that both show up in a filtered log.
        level = logging.WARNING if self._warned_unreachable else logging.INFO
        log.log(
            level,
            "nightjar: connected to the sidecar at %s (%.1f s after start); γ "
            "now comes from the sidecar",
            self.target,
            waited,
        )


def connect_error(target: str, timeout: float = 0.5) -> OSError | None:
    """Why a plain connection to a gRPC ``target`` fails (errno and all), or None when it
    succeeds or the target's form is not one we can probe (gRPC's name resolvers)."""
    if target.startswith("unix:"):
        path = target.removeprefix("unix:")
        # unix:///abs/path (the URI form) and unix:path are both gRPC syntax.
        path = path.removeprefix("//") if path.startswith("///") else path
        return uds.connect_error(path, timeout)
    host, sep, port = target.removeprefix("dns:///").rpartition(":")
    if not sep or not port.isdigit() or "/" in host:
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        return exc
    return None
