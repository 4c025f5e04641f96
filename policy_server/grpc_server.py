"""gRPC front of the decision service: policy + admin servicers, health, reflection.

The servicers only translate: wire messages in, DecisionService calls, wire
messages out, and NightjarError subclasses onto precise status codes.

One ``grpc.aio`` server on one event loop (its own thread): a decision takes a few
microseconds, so the per-step RPCs are answered on the loop itself, with no hand-off
to a worker thread and back (the sync server's two thread switches per message were
most of a round trip). Admin calls, which may write files or copy learned state, run
in a thread pool so they never hold the loop (the loop's plumbing is in aio.py).

The two servicers of the contract (the policy stream with its inbox, and the admin calls)
are one module: they share one error mapping and one service handle.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import sys
import threading
from collections.abc import AsyncIterator, Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer as AioHealthServicer
from nightjar_proto.v1 import admin_pb2, admin_pb2_grpc, policy_pb2, policy_pb2_grpc

from nightjar_common import decode_guard, reflection, uds, wire
from nightjar_common.admin_token import AdminTokenFile, check_admin_token
from nightjar_common.errors import (
    InvalidArgumentError,
    NightjarError,
    UnauthenticatedError,
    status_of,
)
from nightjar_common.sidecar_stream import STREAM_END_IDLE, STREAM_END_KEY
from nightjar_common.types import StepOutcome
from policy_server import bulk_bytes, config
from policy_server.aio import (
    AioDecodeGuard,
    Deferred,
    InThreads,
    LoopServer,
    Serialized,
    deferring,
    serializing,
)
from policy_server.audit import AdminAudit, describe
from policy_server.loop_lag import LoopLag
from policy_server.message_limits import Bound, MessageLimits
from policy_server.metrics import Metrics
from policy_server.policies import PolicyError, parse_params_json
from policy_server.service import ActivePolicy, DecisionService, StateView
from policy_server.state_store import COLLECTOR, document_of_json

log = logging.getLogger(__name__)

POLICY_SERVICE = policy_pb2.DESCRIPTOR.services_by_name["PolicyService"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name

T = TypeVar("T")
# Admin calls that activate a policy: each one refused, for whatever reason (parameters,
# state, a path, the token), counts in nightjar_policy_swaps_total{result="failed"}.
ACTIVATING = frozenset({"SwapPolicy", "SetParameters", "Restore"})
# gRPC's own default, stated: a StepContext with its per-request sections at their bounds
# (validation.Limits) is far smaller. Restore's bound follows the snapshot's (build_server).
DEFAULT_MAX_RECEIVE_BYTES = 4 << 20
RESTORE_METHOD = f"/{ADMIN_SERVICE}/Restore"
# A StepRequest larger than this (a context with thousands of per-request sections) is
# parsed and answered on the heavy-step threads, not on the event loop that answers every
# engine: parsing and deciding it take milliseconds to hundreds (a per-request plan), past
# another engine's 2 ms deadline. Engines' usual requests (no per-request sections, or a
# few dozen) are a few KB and stay on the loop.
HEAVY_REQUEST_BYTES = 64 << 10
# Threads for heavy requests: heavy engines wait for each other, never the light ones.
HEAVY_STEP_THREADS = 2
# How long a thread holding the GIL keeps it while another waits (CPython's default is
# 5 ms, a deadline and a half): an admin call or a heavy step on a thread must hand the
# loop the GIL within a fraction of a decision's deadline.
GIL_SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True, slots=True)
class Received:
    """A StepRequest as received: parsed on the loop when small (``message``); when larger
    than HEAVY_REQUEST_BYTES its bytes (``data``), parsed on a heavy-step thread."""

    size: int
    message: policy_pb2.StepRequest | None = None
    data: bytes | None = None


def _receive(data: bytes) -> Received:
    """StepStream's request deserializer (the decode guard wraps it: a small request that
    does not parse is refused there; a large one is refused when its thread parses it)."""
    if len(data) > HEAVY_REQUEST_BYTES:
        return Received(len(data), data=data)
    return Received(len(data), message=policy_pb2.StepRequest.FromString(data))


def received(message: policy_pb2.StepRequest) -> Received:
    """``message`` as StepStream receives it (for callers in the process: tests)."""
    return Received(message.ByteSize(), message=message)


class UndecodableRequest(Exception):
    """A large StepRequest whose bytes do not parse (the stream ends INVALID_ARGUMENT)."""


def add_policy_service(servicer: PolicyServicer, server: Any) -> None:
    """The PolicyService with StepStream's requests received as Received (the generated
    add_PolicyServiceServicer_to_server parses every request on the loop)."""
    handlers = {
        "StepStream": grpc.stream_stream_rpc_method_handler(
            servicer.StepStream,
            request_deserializer=_receive,
            response_serializer=policy_pb2.StepReply.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(POLICY_SERVICE, handlers),)
    )
    server.add_registered_method_handlers(POLICY_SERVICE, handlers)


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """Engines' streams: how many may be open at once, and how long one may send nothing."""

    max_streams: int = config.DEFAULT_MAX_STREAMS
    idle_timeout_s: float = config.DEFAULT_STREAM_IDLE_TIMEOUT_S
    # Bytes of requests one stream reads ahead of its answers (one request at least).
    max_queue_bytes: int = config.DEFAULT_MAX_STREAM_QUEUE_BYTES


class _Servicer:
    """Shared error translation: NightjarError → status code + message, counted."""

    def __init__(self, service: DecisionService) -> None:
        self.service = service

    def _call(self, method: str, context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except NightjarError as exc:
            self._abort(method, context, status_of(exc), str(exc))

    def _abort(
        self, method: str, context: grpc.ServicerContext, code: grpc.StatusCode, message: str
    ) -> NoReturn:
        self.service.metrics.invalid_requests.labels(method, code.name).inc()
        context.abort(code, message)
        raise AssertionError("unreachable")  # context.abort raises


SUPERSEDED = (
    "superseded: a newer context of this engine arrived on the stream before this one was "
    "decided; its ran steps and outcomes were applied"
)


def _stream_error(seq: int, code: grpc.StatusCode, message: str) -> policy_pb2.StepReply:
    return policy_pb2.StepReply(
        seq=seq, error=policy_pb2.StepError(code=code.value[0], message=message)
    )


@dataclass(frozen=True, slots=True)
class _PolicyNotice:
    """A policy activation to tell a stream about, queued among its requests."""

    version: str


class _StreamInbox:
    """The requests of one StepStream, read ahead by a task of their own.

    Reading ahead lets the handler see that a context is already stale: an engine sends
    its next context only once it stopped waiting for the previous one (it fell back at
    its deadline), so when the sidecar is behind, deciding every queued context in turn
    answers each one too late and the backlog never drains. The newest context of an
    engine is decided; older ones are applied (ran steps, outcomes) and answered ABORTED.
    """

    # Read at most this far ahead of the answers: past it the reader stops, and gRPC's flow
    # control pushes back on the client as without read-ahead (memory stays bounded).
    MAX_READ_AHEAD = 16

    def __init__(
        self,
        requests: AsyncIterator[Received],
        idle_timeout_s: float = config.DEFAULT_STREAM_IDLE_TIMEOUT_S,
        max_queue_bytes: int = config.DEFAULT_MAX_STREAM_QUEUE_BYTES,
        on_full: Callable[[], None] = lambda: None,
    ) -> None:
        # Bytes of the requests queued (as received); past max_queue_bytes the reader
        # stops as past MAX_READ_AHEAD, and on_full counts it.
        self.queued_bytes = 0
        self._max_queue_bytes = max_queue_bytes
        self._on_full = on_full
        self._queue: collections.deque[Received | _PolicyNotice] = collections.deque()
        self.loop = asyncio.get_running_loop()
        self._idle_timeout_s = idle_timeout_s
        self._last_request = self.loop.time()
        self._arrived = asyncio.Event()
        self._room = asyncio.Event()
        self._ended = False
        self._error: BaseException | None = None
        self._reader = asyncio.ensure_future(self._read(requests))

    async def _read(self, requests: AsyncIterator[Received]) -> None:
        try:
            async for request in requests:
                self._last_request = self.loop.time()
                self._queue.append(request)
                self.queued_bytes += request.size
                self._arrived.set()
                if self.queued_bytes >= self._max_queue_bytes:
                    self._on_full()
                while (
                    len(self._queue) >= self.MAX_READ_AHEAD
                    or self.queued_bytes >= self._max_queue_bytes
                ):
                    self._room.clear()
                    await self._room.wait()
        except BaseException as exc:  # the call's end (cancelled, broken): the handler's too
            self._error = exc
        finally:
            self._ended = True
            self._arrived.set()

    def notify(self, version: str) -> None:
        """Queue a policy notice behind the requests already read (on the loop's thread):
        every reply before it was decided by an older version or this one."""
        self._queue.append(_PolicyNotice(version))
        self._arrived.set()

    async def next(self) -> Received | _PolicyNotice | None:
        """The oldest unanswered request or notice; None once the client half-closed;
        StreamIdle once no request came for the idle timeout."""
        while not self._queue:
            if self._ended:
                if self._error is not None and not isinstance(self._error, asyncio.CancelledError):
                    raise self._error
                return None
            self._arrived.clear()
            left = self._last_request + self._idle_timeout_s - self.loop.time()
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=max(left, 0.0))
            except TimeoutError:
                if not self._queue and not self._ended:
                    raise StreamIdle(self._idle_timeout_s) from None
        self._room.set()
        item = self._queue.popleft()
        if isinstance(item, Received):
            self.queued_bytes -= item.size
        return item

    def superseded(self, request: policy_pb2.StepRequest) -> bool:
        """Whether a newer context of the same engine already waits behind ``request``
        (a large request not yet parsed is not looked into)."""
        if not request.HasField("context") or not self._queue:
            return False
        engine_id = request.context.engine_id
        return any(
            isinstance(later, Received)
            and later.message is not None
            and later.message.HasField("context")
            and later.message.context.engine_id == engine_id
            for later in self._queue
        )

    def close(self) -> None:
        self._reader.cancel()


class StreamIdle(Exception):
    """A stream sent nothing for its idle timeout."""

    def __init__(self, idle_timeout_s: float) -> None:
        super().__init__(
            f"stream closed: no request for {idle_timeout_s:g} s (stream_idle_timeout_s, "
            "--stream-idle-timeout-s); open a new stream to go on (the plugin does by itself)"
        )


class PolicyServicer(policy_pb2_grpc.PolicyServiceServicer):  # type: ignore[misc]
    """The engines' streams, answered on the event loop (the service call takes µs)."""

    def __init__(self, service: DecisionService, limits: StreamLimits | None = None) -> None:
        self.service = service
        self._limits = limits or StreamLimits()
        self._open_streams = 0  # changed on the loop only
        # Open streams, told of every policy activation; the set is changed on the loop,
        # read from the admin threads that activate policies.
        self._subscribers: set[_StreamInbox] = set()
        self._subscribers_lock = threading.Lock()
        service.on_activate(self._notify_streams)
        service.metrics.watch_bytes("stream_queues", self._queued_bytes)
        # Heavy requests' parse and step (HEAVY_REQUEST_BYTES), off the loop.
        self._heavy = futures.ThreadPoolExecutor(
            max_workers=HEAVY_STEP_THREADS, thread_name_prefix="heavy-step"
        )

    def _notify_streams(self, active: ActivePolicy) -> None:
        with self._subscribers_lock:
            inboxes = tuple(self._subscribers)
        for inbox in inboxes:
            inbox.loop.call_soon_threadsafe(inbox.notify, active.version)

    def _queued_bytes(self) -> int:
        """Bytes the open streams hold read ahead (nightjar_bytes_held{stream_queues})."""
        with self._subscribers_lock:
            return sum(inbox.queued_bytes for inbox in self._subscribers)

    def _subscribe(self, inbox: _StreamInbox) -> None:
        with self._subscribers_lock:
            self._subscribers.add(inbox)
        inbox.notify(self.service.active.version)  # the version the stream starts with

    def _unsubscribe(self, inbox: _StreamInbox) -> None:
        with self._subscribers_lock:
            self._subscribers.discard(inbox)

    async def StepStream(
        self, request_iterator: AsyncIterator[Received], context: Any
    ) -> AsyncIterator[policy_pb2.StepReply]:
        metrics = self.service.metrics
        if self._open_streams >= self._limits.max_streams:
            metrics.streams_refused.inc()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._open_streams} streams are open, the most this sidecar serves "
                "(max_streams, --max-streams): close unused streams or raise the bound",
            )
        self._open_streams += 1
        metrics.streams_open.set(self._open_streams)
        try:
            async for reply in self._serve(request_iterator):
                yield reply
        except StreamIdle as idle:
            metrics.streams_idle_closed.inc()
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                str(idle),
                trailing_metadata=((STREAM_END_KEY, STREAM_END_IDLE),),
            )
        except UndecodableRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        finally:
            self._open_streams -= 1
            metrics.streams_open.set(self._open_streams)

    async def _serve(
        self, request_iterator: AsyncIterator[Received]
    ) -> AsyncIterator[policy_pb2.StepReply]:
        full = self.service.metrics.child(self.service.metrics.budget_refusals, "stream_queues")
        inbox = _StreamInbox(
            request_iterator, self._limits.idle_timeout_s, self._limits.max_queue_bytes, full.inc
        )
        self._subscribe(inbox)
        try:
            while (received := await inbox.next()) is not None:
                if isinstance(received, _PolicyNotice):
                    yield policy_pb2.StepReply(seq=0, policy_version=received.version)
                elif received.message is not None:
                    yield self._answer(received.message, inbox.superseded(received.message))
                else:
                    # Parsed and answered on a heavy-step thread: the loop serves the others.
                    assert received.data is not None
                    loop = asyncio.get_running_loop()
                    yield await loop.run_in_executor(self._heavy, self._answer_bytes, received.data)
        finally:
            self._unsubscribe(inbox)
            inbox.close()

    def _answer_bytes(self, data: bytes) -> policy_pb2.StepReply:
        """A large request's reply (on a heavy-step thread); UndecodableRequest when its
        bytes are not a StepRequest."""
        # The collector paused: this request's thousands of objects would start collections
        # that scan them holding the GIL; once it is answered most are freed by reference
        # counting, and the deferred collection scans little.
        with COLLECTOR.paused():
            try:
                request = policy_pb2.StepRequest.FromString(data)
            except Exception as exc:  # protobuf raises DecodeError and others
                marker = decode_guard.Undecodable(str(exc) or type(exc).__name__)
                raise UndecodableRequest(
                    decode_guard.describe(f"/{POLICY_SERVICE}/StepStream", marker)
                ) from None
            return self._answer(request, superseded=False)

    def _answer(self, request: policy_pb2.StepRequest, superseded: bool) -> policy_pb2.StepReply:
        """The reply to one request: its table, an ABORTED one when ``superseded``, or the
        error its checks raised."""
        try:
            reply = self._step(request, not superseded)
        except NightjarError as exc:
            code = status_of(exc)
            self.service.metrics.invalid_requests.labels("StepStream", code.name).inc()
            return _stream_error(request.seq, code, str(exc))
        if superseded:
            self.service.metrics.superseded.inc()
            return _stream_error(request.seq, grpc.StatusCode.ABORTED, SUPERSEDED)
        return reply

    def _step(self, request: policy_pb2.StepRequest, decide: bool) -> policy_pb2.StepReply:
        """Apply the request's report batch and, when it carries a context and ``decide``,
        answer with a table for it (its malformed items counted as rejections)."""
        ctx = wire.context_from_pb(request.context) if request.HasField("context") else None
        ran = [wire.ran_step_from_pb(step) for step in request.ran_steps]
        # An outcome the wire cannot even convert is skipped alone, as the service skips
        # one that fails its checks: one bad item does not lose the batch.
        outcomes: list[StepOutcome] = []
        unreadable: list[str] = []
        for message in request.outcomes:
            try:
                outcomes.append(wire.outcome_from_pb(message))
            except InvalidArgumentError as exc:
                unreadable.append(f"outcome {message.decision_id}: {exc}")
        if unreadable and not (ran or outcomes or ctx):
            raise InvalidArgumentError(unreadable[0])
        result = self.service.table_step(ran, outcomes, ctx, decide and ctx is not None)
        for reason in unreadable:
            result.skip(reason)
            result.malformed += 1
        if result.malformed:
            self.service.metrics.invalid_requests.labels("StepStream", "INVALID_ARGUMENT").inc(
                result.malformed
            )
        reply = policy_pb2.StepReply(
            seq=request.seq, skipped=result.skipped, skipped_reason=result.skipped_reason
        )
        if result.table is not None:
            reply.table.CopyFrom(wire.table_to_pb(result.table))
        return reply


# GetState without the admin token (when one is configured): the state of this many
# engines at most, and as many engine ids. The whole state of thousands of engines is
# megabytes, and reading it costs the decisions CPU: only for holders of the token.
SUMMARY_ENGINES = 32
SUMMARY_NOTE = (
    f"a summary: the state of the first {SUMMARY_ENGINES} engines by id; send the admin "
    "token (nightjarctl --token-file) for all of it, or ask for one engine (--engine)"
)


class AdminServicer(_Servicer, admin_pb2_grpc.AdminServiceServicer):  # type: ignore[misc]
    def __init__(self, service: DecisionService, admin_token: str | AdminTokenFile | None) -> None:
        super().__init__(service)
        self._token = admin_token
        # The largest GetState reply: any state a snapshot may hold, with its envelope.
        self._max_reply_bytes = config.admin_message_bytes(service.snapshot_max_bytes)

    def _mutate(self, method: str, context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
        def guarded() -> T:
            try:
                check_admin_token(context, self._token)
                try:
                    return fn()
                except PolicyError as exc:
                    raise InvalidArgumentError(str(exc)) from exc
            except NightjarError:
                if method in ACTIVATING:
                    self.service.metrics.policy_swaps.labels("failed").inc()
                raise

        return self._call(method, context, guarded)

    def GetState(self, request: admin_pb2.GetStateRequest, context: grpc.ServicerContext) -> Any:
        """The whole state for a caller with the admin token (or when none is configured);
        without it a summary: the first SUMMARY_ENGINES engines' parts and ids, and a
        ``summary`` member in state_json with the count of all and how to get the rest.
        One engine's part (engine_id) is open: it is small."""

        def read() -> tuple[StateView, bool]:
            whole = self._holds_token(context)
            limit = None if whole else SUMMARY_ENGINES
            return self.service.state_view(request.engine_id or None, max_engines=limit), whole

        view, whole = self._call("GetState", context, read)
        state_utf8 = view.state_utf8
        if not whole and not request.engine_id:
            state = view.state  # at most SUMMARY_ENGINES engines' parts
            state["summary"] = {
                "engines_total": view.engines_total,
                "engines_shown": len(view.engine_ids),
                "note": SUMMARY_NOTE,
            }
            state_utf8 = json.dumps(state, sort_keys=True).encode()
        reply = admin_pb2.GetStateResponse(
            policy_name=view.policy_name,
            policy_version=view.policy_version,
            params_json=json.dumps(view.params, sort_keys=True),
            decisions_total=view.decisions_total,
            reports_total=view.reports_total,
            engine_ids=view.engine_ids,
            last_snapshot_unix=view.last_snapshot_unix,
            memory_json=json.dumps(view.memory, sort_keys=True),
            engines_json=json.dumps(view.engines, sort_keys=True),
            fleet_json=json.dumps(view.fleet, sort_keys=True),
        )
        # state_json (field 4) framed by hand, its UTF-8 as read, and joined by the kernel
        # (bulk_bytes): a state of tens of MB as one string would hold the GIL in
        # protobuf's C for each copy, and the loop would serialize it; the loop only sends
        # these bytes.
        parts = [reply.SerializeToString(), *_string_field(4, state_utf8)]
        size = sum(map(len, parts))
        if size > self._max_reply_bytes:
            self._abort(
                "GetState",
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the state is {size:,} bytes, more than the {self._max_reply_bytes:,} a "
                f"GetState reply may carry (snapshot_max_bytes = "
                f"{self.service.snapshot_max_bytes:,}, plus {config.ADMIN_ENVELOPE_BYTES:,} "
                "for engine ids and runtimes): ask for one engine (engine_id, nightjarctl "
                "state --engine)",
            )
        return Serialized(bulk_bytes.joined(parts))

    def _holds_token(self, context: grpc.ServicerContext) -> bool:
        """Whether a read-only call may read the whole state: no admin token is configured,
        or it sends the right one. Read-only calls never fail for the token: one sending
        none, a wrong one, or one the server cannot check (its token file unusable) is
        answered the summary, whose note says how to get the rest."""
        if self._token is None:
            return True
        try:
            check_admin_token(context, self._token)
        except UnauthenticatedError:
            return False
        return True

    def ListPolicies(
        self, request: admin_pb2.ListPoliciesRequest, context: grpc.ServicerContext
    ) -> Any:
        return admin_pb2.ListPoliciesResponse(
            policies=[
                admin_pb2.PolicyInfo(
                    name=name,
                    description=description,
                    default_params_json=json.dumps(defaults, sort_keys=True),
                    active=active,
                )
                for name, description, defaults, active in self.service.list_policies()
            ]
        )

    def SwapPolicy(
        self, request: admin_pb2.SwapPolicyRequest, context: grpc.ServicerContext
    ) -> Any:
        active = self._mutate(
            "SwapPolicy",
            context,
            lambda: self.service.swap(
                request.name, parse_params_json(request.params_json), request.keep_state
            ),
        )
        return _swap_response(active)

    def SetParameters(
        self, request: admin_pb2.SetParametersRequest, context: grpc.ServicerContext
    ) -> Any:
        active = self._mutate(
            "SetParameters",
            context,
            lambda: self.service.set_params(parse_params_json(request.params_json)),
        )
        return _swap_response(active)

    def Snapshot(self, request: admin_pb2.SnapshotRequest, context: grpc.ServicerContext) -> Any:
        path = self._mutate("Snapshot", context, self.service.write_snapshot)
        return admin_pb2.SnapshotResponse(
            path=str(path), created_unix=self.service.last_snapshot_unix
        )

    def Restore(
        self, request: admin_pb2.RestoreRequest | Deferred, context: grpc.ServicerContext
    ) -> Any:
        """A large request (Deferred: a snapshot_json of MBs) is parsed where the snapshot
        is read and checked: in a forked child when there are children (StateStore.
        restore_client), so that neither its protobuf nor its JSON is parsed holding the
        sidecar's GIL."""

        def document() -> dict[str, Any]:
            parsed = request.parsed() if isinstance(request, Deferred) else request
            source = parsed.WhichOneof("source")
            if source == "path":
                return self.service.document_at(parsed.path)
            if source == "snapshot_json":
                return document_of_json(parsed.snapshot_json, "snapshot_json")
            raise InvalidArgumentError("restore needs a path or snapshot_json")

        active = self._mutate("Restore", context, lambda: self.service.restore_client(document))
        return admin_pb2.RestoreResponse(policy_name=active.name, policy_version=active.version)

    def Reset(self, request: admin_pb2.ResetRequest, context: grpc.ServicerContext) -> Any:
        active = self._mutate(
            "Reset", context, lambda: self.service.reset(request.engine_id or None)
        )
        return admin_pb2.ResetResponse(policy_version=active.version)


def _string_field(number: int, utf8: bytes) -> list[bytes]:
    """A protobuf string field in parts, as SerializeToString writes it: its tag, length
    and UTF-8 bytes (none for an empty string, a proto3 default)."""
    if not utf8:
        return []
    return [_varint(number << 3 | 2), _varint(len(utf8)), utf8]


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def add_admin_service(servicer: InThreads, server: Any) -> None:
    """The AdminService with requests over HEAVY_REQUEST_BYTES parsed on the admin threads
    (Deferred) and replies they serialized sent as they are (Serialized): what the
    generated add_AdminServiceServicer_to_server does on the loop."""
    service = admin_pb2.DESCRIPTOR.services_by_name["AdminService"]
    handlers = {}
    for method in service.methods:
        request_type = getattr(admin_pb2, method.input_type.name)
        reply_type = getattr(admin_pb2, method.output_type.name)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name),
            request_deserializer=deferring(
                f"/{ADMIN_SERVICE}/{method.name}", request_type.FromString, HEAVY_REQUEST_BYTES
            ),
            response_serializer=serializing(reply_type.SerializeToString),
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(ADMIN_SERVICE, handlers),)
    )
    server.add_registered_method_handlers(ADMIN_SERVICE, handlers)


def _swap_response(active: ActivePolicy) -> admin_pb2.SwapPolicyResponse:
    return admin_pb2.SwapPolicyResponse(policy_name=active.name, policy_version=active.version)


@dataclass
class RunningServer:
    server: LoopServer
    health: AioHealthServicer
    addresses: list[str]
    metrics: Metrics | None = None  # its nightjar_serving gauge follows the health status

    def set_serving(self, serving: bool) -> None:
        if self.metrics is not None:
            self.metrics.serving.set(1.0 if serving else 0.0)
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", POLICY_SERVICE, ADMIN_SERVICE):
            self.server.run(self.health.set(name, status))


def _message_limits(
    service: DecisionService, max_receive_bytes: int, admin_bytes: int
) -> MessageLimits:
    """Every method's requests held to max_receive_bytes, Restore's to what a snapshot
    may take; refusals counted as invalid requests."""
    restore = Bound(
        admin_bytes,
        f"snapshot_max_bytes = {service.snapshot_max_bytes:,} plus "
        f"{config.ADMIN_ENVELOPE_BYTES:,} for the request's other fields: a larger "
        "snapshot could not be written back",
    )
    default = Bound(max_receive_bytes, "max_receive_bytes in the server's config file")

    def refused(method: str) -> None:
        name = method.rsplit("/", 1)[-1]
        service.metrics.invalid_requests.labels(name, "RESOURCE_EXHAUSTED").inc()

    return MessageLimits(default, {RESTORE_METHOD: restore}, refused)


def bind_ports(
    server: Any,
    uds_path: str | None,
    tcp_address: str | None,
    uds_mode: int,
    tls: grpc.ServerCredentials | None,
) -> list[str]:
    """Every port the sidecar listens on is bound here: the Unix socket (with its mode)
    and the TCP address (plaintext, or with ``tls`` credentials). The bound addresses."""
    addresses = []
    if uds_path:
        addresses.append(uds.bind(server, uds_path, uds_mode))
    if tcp_address:
        if tls is None:
            port = server.add_insecure_port(tcp_address)
        else:
            port = server.add_secure_port(tcp_address, tls)
        host = tcp_address.rsplit(":", 1)[0]
        addresses.append(f"{host}:{port}")
    return addresses


def build_server(
    service: DecisionService,
    *,
    uds_path: str | None = None,
    tcp_address: str | None = None,
    admin_token: str | AdminTokenFile | None = None,
    max_workers: int = 16,
    uds_mode: int = uds.DEFAULT_MODE,
    tls: grpc.ServerCredentials | None = None,
    max_receive_bytes: int = DEFAULT_MAX_RECEIVE_BYTES,
    streams: StreamLimits | None = None,
) -> RunningServer:
    """Create, bind and start the gRPC server; health turns SERVING once a policy is active.

    ``uds_mode``: the Unix socket's file mode (nightjar_common/uds.py), set before serving.
    ``tls``: credentials for the TCP port (nightjar_common/tls.py); None = plaintext.
    ``max_receive_bytes``: larger requests are refused (RESOURCE_EXHAUSTED) unread, but
    Restore's, bounded by the snapshot's size (admin_message_bytes: any state a snapshot
    holds can be restored, and read with GetState).
    ``streams``: the engines' streams' cap and idle timeout.
    """
    if not uds_path and not tcp_address:
        raise ValueError("need a Unix socket path or a TCP address to listen on")
    # Process-wide: the loop gets the GIL back from an admin call's or a heavy step's
    # thread within this, not CPython's default 5 ms.
    sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
    loop = asyncio.new_event_loop()
    loop.set_default_executor(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc-admin")
    )
    thread = threading.Thread(target=loop.run_forever, name="grpc-loop", daemon=True)
    thread.start()

    limits = _message_limits(
        service, max_receive_bytes, config.admin_message_bytes(service.snapshot_max_bytes)
    )
    # gRPC's own bound, for every method: the most any sidecar's Restore takes, so that a
    # request past this one's (a smaller snapshot_max_bytes) is refused with its setting
    # named (MessageLimits), not with gRPC's bare message. Nothing is parsed before that.
    transport_bytes = max(max_receive_bytes, config.admin_message_bytes())

    async def create() -> tuple[grpc.aio.Server, AioHealthServicer, list[str]]:
        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", transport_bytes),
                ("grpc.max_send_message_length", transport_bytes),
            ],
            # The audit outermost: it logs the size and decode guards' refusals too.
            interceptors=[AdminAudit(ADMIN_SERVICE), limits, AioDecodeGuard()],
        )
        add_policy_service(PolicyServicer(service, streams), server)
        admin = InThreads(AdminServicer(service, admin_token), describe, frozenset({"Restore"}))
        add_admin_service(admin, server)
        health_servicer = AioHealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (POLICY_SERVICE, ADMIN_SERVICE, health.SERVICE_NAME), server
        )
        addresses = bind_ports(server, uds_path, tcp_address, uds_mode, tls)
        await server.start()
        LoopLag(service.metrics.loop_lag.observe).start(asyncio.get_running_loop())
        return server, health_servicer, addresses

    try:
        server, health_servicer, addresses = asyncio.run_coroutine_threadsafe(
            create(), loop
        ).result()
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        raise
    looped = LoopServer(server, loop)
    looped._thread = thread
    running = RunningServer(looped, health_servicer, addresses, service.metrics)
    running.set_serving(True)
    return running
