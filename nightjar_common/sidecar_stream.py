"""The transport to the sidecar: one ``StepStream`` per engine, replies matched by seq.

It knows requests, replies and errors, nothing of what they mean: the table protocol
(client.py) builds the requests, the connection (sidecar_connection.py) opens and
reopens streams.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

import grpc
from nightjar_proto.v1 import policy_pb2, policy_pb2_grpc

# Trailing metadata of a stream the sidecar closed because it sent nothing for its idle
# timeout (nightjar-server --stream-idle-timeout-s): a normal end, not a lost sidecar,
# which still holds the engine's tables.
STREAM_END_KEY = "nightjar-stream-end"
STREAM_END_IDLE = "idle"


class NotSent(ConnectionError):
    """No connection to the sidecar was up to send the request on."""


class StreamEnded(ConnectionError):
    """The stream ended: ``code`` and ``details`` are the gRPC status it ended with
    (UNAVAILABLE: the sidecar went away, or with ``idle`` closed the stream for sending
    nothing for a while; UNIMPLEMENTED: the target serves no PolicyService), or None when
    it ended without one."""

    def __init__(
        self, code: grpc.StatusCode | None = None, details: str = "", idle: bool = False
    ) -> None:
        super().__init__(f"stream broken: {code.name}" if code is not None else "stream ended")
        self.code = code
        self.details = details
        self.idle = idle


class PendingReply:
    """A reply that will arrive from the sidecar: one waiter, any number of callbacks.

    Lighter than concurrent.futures.Future (a SimpleQueue wake-up instead of a
    Condition), which matters at a 2 ms budget.
    """

    __slots__ = ("_callbacks", "_error", "_lock", "_reply", "_wakeup", "done")

    def __init__(self) -> None:
        self._wakeup: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[PendingReply], None]] = []
        self._reply: policy_pb2.StepReply | None = None
        self._error: BaseException | None = None
        self.done = False

    def resolve(
        self, reply: policy_pb2.StepReply | None = None, error: BaseException | None = None
    ) -> None:
        """Resolve it: the callbacks run first, then the waiter wakes (so a waiter finds
        what a callback installs, e.g. a table, and does not parse it again itself)."""
        with self._lock:
            if self.done:
                return
            self._reply, self._error, self.done = reply, error, True
            callbacks, self._callbacks = self._callbacks, []
        try:
            for callback in callbacks:
                callback(self)
        finally:
            self._wakeup.put(None)

    def result(self, timeout: float) -> policy_pb2.StepReply:
        """The reply; TimeoutError past ``timeout``, or the transport's error."""
        if not self.done:
            try:
                self._wakeup.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError from None
        if self._error is not None:
            raise self._error
        assert self._reply is not None
        return self._reply

    @property
    def failed(self) -> bool:
        return self.done and self._error is not None

    def add_done_callback(self, callback: Callable[[PendingReply], None]) -> None:
        with self._lock:
            if not self.done:
                self._callbacks.append(callback)
                return
        callback(self)

    def relay_to(self, other: PendingReply) -> None:
        """Resolve ``other`` as this one resolves (after this one's earlier callbacks)."""
        self.add_done_callback(lambda done: other.resolve(done._reply, done._error))


class StepStream:
    """One open ``StepStream``: requests go on a queue, replies resolve them by seq.

    ``on_notice(version)`` runs on the reader thread for each policy notice (the sidecar
    sends one when the stream opens and one per policy change); ``on_broken(stream)`` once,
    when the stream ends, after every unanswered request failed with ConnectionError.
    """

    def __init__(
        self,
        channel: grpc.Channel,
        on_broken: Callable[[StepStream], None],
        on_notice: Callable[[str], None],
    ) -> None:
        self._requests: queue.SimpleQueue[policy_pb2.StepRequest | None] = queue.SimpleQueue()
        self._pending: dict[int, PendingReply] = {}
        self._lock = threading.Lock()
        self._on_broken = on_broken
        self._on_notice = on_notice
        self.alive = True
        # Why the stream ended, for requests sent after it did.
        self._ended: StreamEnded | None = None
        stub = policy_pb2_grpc.PolicyServiceStub(channel)
        self._call = stub.StepStream(self._request_iter())
        self._reader = threading.Thread(target=self._read, name="nightjar-stream", daemon=True)
        self._reader.start()

    def _request_iter(self) -> Iterator[policy_pb2.StepRequest]:
        while True:
            request = self._requests.get()
            if request is None:
                return
            yield request

    def send(self, request: policy_pb2.StepRequest) -> PendingReply:
        """Queue ``request``; its reply, or ConnectionError once the stream is gone."""
        pending = PendingReply()
        with self._lock:
            if not self.alive:
                pending.resolve(error=self._ended or StreamEnded())
                return pending
            self._pending[request.seq] = pending
        self._requests.put(request)
        return pending

    def _read(self) -> None:
        error = StreamEnded()
        try:
            for reply in self._call:
                if reply.seq == 0 and reply.policy_version:
                    self._on_notice(reply.policy_version)
                    continue
                with self._lock:
                    pending = self._pending.pop(reply.seq, None)
                if pending is not None:
                    pending.resolve(reply)
        except grpc.RpcError as exc:
            error = StreamEnded(exc.code(), str(exc.details()), _closed_idle(exc))
        with self._lock:
            self.alive = False
            self._ended = error
            unanswered, self._pending = self._pending, {}
        for pending in unanswered.values():
            pending.resolve(error=error)
        self._on_broken(self)

    @property
    def ended(self) -> StreamEnded | None:
        """Why the stream ended; None while it is open."""
        return self._ended

    def close(self) -> None:
        with self._lock:
            self.alive = False
        self._requests.put(None)
        self._call.cancel()


def _closed_idle(error: grpc.RpcError) -> bool:
    """Whether the sidecar ended the stream for being idle (STREAM_END_KEY)."""
    trailing = getattr(error, "trailing_metadata", None)
    metadata = trailing() if callable(trailing) else None
    return any(key == STREAM_END_KEY and value == STREAM_END_IDLE for key, value in metadata or ())


class SyncStream:
    """A ``StepStream`` used one request at a time, for tools and tests: :meth:`send`
    sends a request and returns its reply (or raises what ended the stream); the policy
    notices the sidecar sends meanwhile are kept in :attr:`policy_versions`."""

    def __init__(self, channel: grpc.Channel, timeout_s: float = 10.0) -> None:
        self._timeout_s = timeout_s
        self._seq = 0
        self._notices: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._versions: list[str] = []
        self._stream = StepStream(channel, lambda _: None, self._notices.put)

    def send(self, request: policy_pb2.StepRequest) -> policy_pb2.StepReply:
        """Send ``request`` (its seq set here) and wait for its reply."""
        self._seq += 1
        request.seq = self._seq
        return self._stream.send(request).result(self._timeout_s)

    @property
    def policy_versions(self) -> list[str]:
        """The policy versions the sidecar announced so far, oldest first (the first: the
        version active when the stream opened)."""
        while not self._notices.empty():
            self._versions.append(self._notices.get_nowait())
        return list(self._versions)

    def close(self) -> None:
        self._stream.close()

    def __enter__(self) -> SyncStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
