"""Fail-open client of the Nightjar sidecar, used by the vLLM plugin and the simulator.

The engine must never wait on the sidecar longer than a step can afford:

* every decision has a deadline (default 2 ms); past it, or while the sidecar is
  unreachable, γ comes from a local fallback table (vLLM's dynamic-SD shape) and
  the fallback is counted, like Envoy's ``failure_mode_allowed``;
* one long-lived bidirectional stream per engine (or unary calls) carries each
  step's previous outcome together with the next context: one round trip a step;
* pipelined mode asks for step t+1 while step t runs (:meth:`prefetch`), so the
  engine's critical path only reads a ready answer (:meth:`take`);
* with decision tables (nightjar.v1.7, the default) a step is answered from the newest
  table of γ per batch size the sidecar sent (nightjar_common/tables.py), and the steps
  run and their outcomes go to the sidecar in batches, from a sender thread: the engine's
  thread builds no protobuf and waits on nothing unless its table cannot answer;
* a background thread reconnects with backoff after the sidecar goes away.

The client's connection, stream, prefetch and fallback share one lock and one reader
thread, so they stay together.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
from nightjar_proto.v1 import policy_pb2, policy_pb2_grpc

from nightjar_common import uds, wire
from nightjar_common.fallback import DEFAULT_SCHEDULE, BatchSizeTable
from nightjar_common.tables import (
    AheadStep,
    LazyStep,
    NextStep,
    ReportBatch,
    TableCache,
    TableStep,
    refresh_due,
)
from nightjar_common.tls import ClientTls, open_channel
from nightjar_common.types import (
    BinType,
    Decision,
    MemoryDirective,
    RanStep,
    StepContext,
    StepOutcome,
)
from nightjar_common.validation import MAX_BATCHED

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
# How long closing waits for the sidecar to apply the last report batch.
CLOSE_FLUSH_S = 1.0
# What an operator should check, by the error connecting to the sidecar's address.
_HINTS = {
    PermissionError: "the engine's user needs write access to the socket: run it in the "
    "socket's group (the sidecar creates it with mode 0660; Kubernetes: fsGroup)",
    FileNotFoundError: "no socket there: is the sidecar running, and does the engine "
    "mount the sidecar's socket directory?",
    ConnectionRefusedError: "nothing listens there (a stopped sidecar's socket, or the wrong port)",
}


# Steps one decision table serves before the client asks for the next, or its age in ms
# (ClientConfig), whichever comes first. The simulator learns as well refreshing every 32
# steps as every 8; each refresh costs the sidecar a round trip and a table, so fewer
# refreshes is most of its CPU at fast steps (docs/DECISION_TABLES.md, "Refresh period").
# The age stays well inside a table's validity (GammaTable.valid_ms, 1 s by default).
TABLE_REFRESH_STEPS = 32
TABLE_REFRESH_MS = 200.0
# Outcomes queued before the sender thread sends them without asking for a table: a
# request that must be answered while the engine waits (a step the table cannot answer)
# then carries at most this many to be learned from before its table is decided.
REPORT_BATCH_OUTCOMES = 8


@dataclasses.dataclass(frozen=True, slots=True)
class ClientConfig:
    # "unix:/path/to/socket" or "host:port".
    target: str
    engine_id: str
    # Longest the engine waits for a decision before falling back.
    deadline_s: float = 0.002
    # Local fail-open policy: [[start_bs, end_bs, gamma], ...].
    fallback_schedule: Sequence[Sequence[int]] = DEFAULT_SCHEDULE
    fallback_default_gamma: int = 0
    # One bidirectional stream per engine (fastest) or unary Step calls.
    use_stream: bool = True
    # How long to wait for a connection at start-up (0 = do not wait).
    connect_timeout_s: float = 0.0
    # TLS (mutual with a client certificate) to a host:port sidecar; None = plaintext.
    tls: ClientTls | None = None
    # Decision tables (nightjar.v1.7): steps are answered from the newest table of γ per
    # batch size the sidecar sent, without a round trip, and reported in batches. False:
    # one decision per step (what a sidecar older than v1.7 gets anyway).
    decision_tables: bool = True
    # Ask for a new table after this many steps from one, or once it is this old; the
    # answer arrives while the engine runs on the held one.
    table_refresh_steps: int = TABLE_REFRESH_STEPS
    table_refresh_ms: float = TABLE_REFRESH_MS


@dataclasses.dataclass(slots=True)
class GammaDecision:
    """The γ to run and where it came from."""

    gamma: int
    # "sidecar" or "fallback".
    source: str
    # The sidecar's decision for this step (a round trip), or the table entry it ran.
    decision: Decision | None = None
    fallback_reason: str = ""
    table_step: TableStep | None = None

    @property
    def decision_id(self) -> str | None:
        if self.table_step is not None:
            return self.table_step.decision_id
        return self.decision.decision_id if self.decision else None

    @property
    def policy_name(self) -> str:
        """The policy that decided ("" for a fallback)."""
        if self.table_step is not None:
            return self.table_step.held.table.policy_name
        return self.decision.policy_name if self.decision else ""

    @property
    def bin_type(self) -> BinType | None:
        """How the sidecar chose γ (None for a fallback)."""
        if self.table_step is not None:
            taken = self.table_step
            table = taken.held.table
            return table.reason or (BinType.EXPLORE if taken.exploring else BinType.EXPLOIT)
        return self.decision.bin_type if self.decision else None

    @property
    def request_gammas(self) -> tuple[tuple[str, int], ...]:
        """Per-request γ of a per-request policy (each capped at :attr:`gamma` by the
        engine); () = every request runs :attr:`gamma`."""
        if self.table_step is not None:
            return self.table_step.held.table.request_gammas
        return self.decision.request_gammas if self.decision else ()

    @property
    def reads_request_signals(self) -> bool | None:
        """Whether the deciding policy reads per-request signals; None for a fallback
        (the local table says nothing of the sidecar's policy)."""
        if self.table_step is not None:
            return self.table_step.held.table.reads_request_signals
        return self.decision.reads_request_signals if self.decision else None


class Wakeup:
    """A wake-up flag for one waiting thread, like ``threading.Event`` with ``wait`` also
    clearing it. :meth:`set` is one C call (``queue.SimpleQueue.put``), where an Event's
    set runs its condition's Python code: the engine's thread sets it."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[None] = queue.SimpleQueue()

    def set(self) -> None:
        self._queue.put(None)

    def wait(self, timeout: float) -> bool:
        """Whether it was set within ``timeout`` seconds (or already); clears it."""
        try:
            self._queue.get(timeout=timeout)
        except queue.Empty:
            return False
        while True:  # sets before this wake-up are answered by it
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return True


def _nothing() -> None:
    """No deferred reports to gather."""


@dataclasses.dataclass(slots=True)
class ClientStats:
    decisions: int = 0
    sidecar_decisions: int = 0
    fallbacks: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    rejected_reports: int = 0
    late_replies: int = 0
    reconnects: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    # Why: the batch size was not among those asked for ("batch_size"), the answer was for
    # another step ("step"), a policy notice came after it ("policy"), or the sidecar had no
    # answer for that batch size ("answer": one without candidate support).
    prefetch_miss_reasons: collections.Counter[str] = dataclasses.field(
        default_factory=collections.Counter
    )
    # Policy notices received (the first on each stream confirms that they come).
    policy_notices: int = 0
    # Decision tables: installed, and steps that found no usable entry, by why
    # (nightjar_common/tables.py); a miss waits up to the deadline for a table.
    tables: int = 0
    table_misses: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    # Table requests sent by steps that missed: one in flight at a time, later misses
    # wait for it.
    miss_requests: int = 0
    # Table requests sent ahead of need: the held table due for a refresh, or outlived
    # (one may follow a miss's unanswered request: the next step's, behind it).
    refresh_requests: int = 0

    @property
    def fallbacks_total(self) -> int:
        return sum(self.fallbacks.values())


class SidecarRejected(Exception):
    """The sidecar answered with an error status (bad input)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"sidecar rejected the request (code {code}): {message}")
        self.code = code


class NotSent(ConnectionError):
    """No connection to the sidecar was up to send the request on."""


class PendingReply:
    """A reply that will arrive from the sidecar: one waiter, any number of callbacks.

    Lighter than concurrent.futures.Future (a SimpleQueue wake-up instead of a
    Condition), which matters at a 2 ms budget.
    """

    __slots__ = ("_callbacks", "_error", "_lock", "_reply", "_wakeup", "done", "names_ran")

    def __init__(self) -> None:
        self._wakeup: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[PendingReply], None]] = []
        self._reply: policy_pb2.StepReply | None = None
        self._error: BaseException | None = None
        self.done = False
        # The tentative decision the request named as run (StepContext.ran_decision_id),
        # until the client names it again after a rejection (NightjarClient._rename_ran).
        self.names_ran = ""

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


class _StreamTransport:
    """One StepStream: requests go on a queue, replies resolve futures by seq."""

    def __init__(
        self, channel: grpc.Channel, on_broken: Any, on_notice: Callable[[str], None]
    ) -> None:
        self._stub = policy_pb2_grpc.PolicyServiceStub(channel)
        self._requests: queue.SimpleQueue[policy_pb2.StepRequest | None] = queue.SimpleQueue()
        self._futures: dict[int, PendingReply] = {}
        self._lock = threading.Lock()
        self._on_broken = on_broken
        self._on_notice = on_notice
        self.alive = True
        # Whether the sidecar sends policy notices on this stream (it confirms with the
        # first one; a sidecar older than v1.4 never does).
        self.notices = False
        self._asked_notices = False
        self._call = self._stub.StepStream(self._request_iter())
        self._reader = threading.Thread(target=self._read, name="nightjar-stream", daemon=True)
        self._reader.start()

    def _request_iter(self) -> Iterator[policy_pb2.StepRequest]:
        while True:
            request = self._requests.get()
            if request is None:
                return
            yield request

    def send(self, request: policy_pb2.StepRequest) -> PendingReply:
        future: PendingReply = PendingReply()
        with self._lock:
            if not self.alive:
                future.resolve(error=ConnectionError("stream closed"))
                return future
            self._futures[request.seq] = future
            if not self._asked_notices:
                request.policy_notices = self._asked_notices = True
        self._requests.put(request)
        return future

    def _read(self) -> None:
        error: BaseException = ConnectionError("stream ended")
        try:
            for reply in self._call:
                if reply.seq == 0 and reply.policy_version:
                    self.notices = True
                    self._on_notice(reply.policy_version)
                    continue
                with self._lock:
                    future = self._futures.pop(reply.seq, None)
                if future is not None:
                    future.resolve(reply)
        except grpc.RpcError as exc:
            error = ConnectionError(f"stream broken: {exc.code().name}")
        with self._lock:
            self.alive = False
            pending, self._futures = self._futures, {}
        for future in pending.values():
            future.resolve(error=error)
        self._on_broken(self)

    def close(self) -> None:
        with self._lock:
            self.alive = False
        self._requests.put(None)
        self._call.cancel()


class _UnaryTransport:
    """Unary Step calls; the channel reconnects by itself."""

    def __init__(self, channel: grpc.Channel, deadline_s: float) -> None:
        self._stub = policy_pb2_grpc.PolicyServiceStub(channel)
        # The RPC deadline is generous: the caller's wait is bounded separately, and a
        # late reply still lands (so the server's bookkeeping stays consistent).
        self._rpc_timeout = max(1.0, 50 * deadline_s)
        self.alive = True

    def send(self, request: policy_pb2.StepRequest) -> PendingReply:
        future: PendingReply = PendingReply()
        call = self._stub.Step.future(request, timeout=self._rpc_timeout)

        def done(call_future: Any) -> None:
            try:
                future.resolve(call_future.result())
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    future.resolve(error=ConnectionError(exc.code().name))
                else:
                    error = SidecarRejected(exc.code().value[0], str(exc.details()))
                    future.resolve(error=error)

        call.add_done_callback(done)
        return future

    def close(self) -> None:
        self.alive = False


class NightjarClient:
    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.stats = ClientStats()
        self._fallback = BatchSizeTable(config.fallback_schedule, config.fallback_default_gamma)
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._pending_outcome: StepOutcome | None = None
        # The tentative decision take() picked: named to the sidecar with the next context.
        self._ran_decision_id = ""
        self._directives: list[MemoryDirective] = []
        # Swapped by the engine's thread (prefetch, take) and by the stream's reader thread
        # (asking again after a policy notice), under _prefetch_lock.
        self._prefetched: tuple[StepContext, PendingReply, int] | None = None
        self._prefetch_lock = threading.Lock()
        # Policy changes announced by notices: a prefetched answer asked for before the
        # latest may have been decided by a policy that is no longer active.
        self._policy_epoch = 0
        self._policy_version: str | None = None
        self._transport: _StreamTransport | _UnaryTransport | None = None
        self._closed = threading.Event()
        self._broken = threading.Event()
        # Start-up diagnostics: one warning while the sidecar cannot be reached, one line
        # when it first answers (the reconnect thread owns these).
        self._started = time.monotonic()
        self._warned_unreachable = False
        self._ready_wait_ended = 0.0
        # Set once the first transport is up. The first request of a fresh client waits
        # for it, within its deadline (the channel connects in the background: without
        # the wait an engine's first decisions always fell back); later ones never wait.
        self._first_connection = threading.Event()
        self._waited_for_first = False
        # Unary mode's connectivity subscription (the stream's end tells the stream mode).
        self._unary_watch: Callable[[grpc.ChannelConnectivity], None] | None = None
        # Decision tables: the held table and the report batch (the engine's thread uses
        # both without a lock); requests that drain the batch are sent under _send_lock, so
        # the sidecar applies batches in the order they were drained.
        self._use_tables = config.decision_tables
        self._tables = TableCache()
        self._reports = ReportBatch()
        self._send_lock = threading.Lock()
        # The step a refresh is for, handed to the sender thread (None once sent, or once
        # a blocking request for a later step made it moot: sent after that one, it would
        # supersede it); the latest such step (asked for again after a policy change); a
        # refresh in flight.
        self._refresh_step: AheadStep | None = None
        self._next_step: AheadStep | None = None
        self._refresh_wanted = Wakeup()
        self._refreshing = False
        # Set by the engine's thread when REPORT_BATCH_OUTCOMES are queued: the sender
        # thread sends them.
        self._flush_wanted = False
        # The reply to the table request of the last step the held table could not
        # answer: one such request is in flight at a time (see _wait_for_table). The
        # engine's thread hands the step to the sender thread (_miss_step), which sends
        # the request and relays its reply.
        self._miss_request: PendingReply | None = None
        self._miss_step: tuple[StepContext, PendingReply] | None = None
        # Queues a caller's deferred reports before a batch is taken (gather_reports_with).
        self._gather: Callable[[], None] = _nothing
        self._sender: threading.Thread | None = None
        if self._use_tables:
            self._sender = threading.Thread(
                target=self._send_loop, name="nightjar-tables", daemon=True
            )
            self._sender.start()
        # TLS is the channel's business: calls over it are the same as over plaintext.
        self._channel = open_channel(config.target, config.tls, CHANNEL_OPTIONS)
        self._reconnector = threading.Thread(
            target=self._reconnect_loop, name="nightjar-reconnect", daemon=True
        )
        self._broken.set()
        self._reconnector.start()
        if config.connect_timeout_s > 0:
            self.wait_connected(config.connect_timeout_s)

    # -- public API -------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        transport = self._transport
        return transport is not None and transport.alive

    def wait_connected(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.connected:
                return True
            time.sleep(0.01)
        return self.connected

    @property
    def follows_policy_changes(self) -> bool:
        """Whether the sidecar tells this client of policy changes (StepStream notices,
        nightjar.v1.4), so that an answer kept for a step much later stays current."""
        transport = self._transport
        return isinstance(transport, _StreamTransport) and transport.alive and transport.notices

    @property
    def uses_tables(self) -> bool:
        """Whether steps are answered from decision tables (asked for, and the sidecar
        sends them: one older than v1.7 answers with a decision instead)."""
        return self._use_tables

    def decide(self, ctx: StepContext) -> GammaDecision:
        """γ for the step described by ``ctx``, within the deadline or from the fallback."""
        if self._use_tables:
            taken = self._take_from_table(ctx)
            if self._use_tables:  # the next step is like this one, after this γ
                self._refresh_if_due(NextStep(ctx, taken.gamma))
            return taken
        future = self._send(ctx)
        decision = self._resolve(ctx, future, ctx.batch_size)
        assert decision is not None  # the answer for the asked batch size is the decision
        return decision

    def prefetch(self, ctx: StepContext) -> None:
        """Pipelined mode: ask now for a step that will run later (see :meth:`take`).

        ``ctx.candidate_batch_sizes``: other batch sizes the step may turn out to have; the
        sidecar decides each tentatively and learns only from the one the engine ran,
        which :meth:`take` picks and names to it with the next request.

        With decision tables: ask for a new table for ``ctx``'s step now, whatever the held
        one (its candidate sizes are not needed: a table covers the sizes around it). For
        the step after an idle gap: a held table that served before the gap may expire
        during it, while a new one's time starts at its first step."""
        if self._use_tables:
            self._refresh_if_due(NextStep(ctx), always=True)
            return
        with self._prefetch_lock:
            self._ask_ahead_locked(ctx)

    def prefetch_after(self, ctx: StepContext, gamma: int) -> None:
        """Ask ahead for the step after ``ctx``'s, which runs at ``gamma`` (like it
        otherwise). With decision tables: a new table when the held one is due for a
        refresh or will not answer that step; that step's context is built only then, by
        the sender thread (cheaper on the engine's thread)."""
        if self._use_tables:
            self._refresh_if_due(NextStep(ctx, gamma))
            return
        self.prefetch(NextStep(ctx, gamma).context())

    def take_from_table(self, batch_size: int, speculation_off: bool) -> TableStep | None:
        """The held table's entry for a step of ``batch_size`` (after a step at γ = 0 when
        ``speculation_off``), counted as a sidecar decision; None when it has none (then
        :meth:`take` the step: it asks for a table, waits, or falls back). Unlike
        :meth:`take`, nothing is reported: the caller reports the step with :meth:`ran`,
        from any thread, in the order its steps ran (the engine's thread builds no
        context). None also without decision tables."""
        if not self._use_tables:
            return None
        taken = self._tables.take_size(batch_size, speculation_off, time.monotonic())
        if isinstance(taken, str):
            return None
        stats = self.stats
        stats.decisions += 1
        stats.sidecar_decisions += 1
        return taken

    def ran(self, step: TableStep, ctx: StepContext) -> None:
        """Report a step run from :meth:`take_from_table`'s entry, with its context
        (unless its table came on a connection since lost: that sidecar is gone)."""
        if self._tables.current(step.held):
            self._reports.ran(RanStep(step.decision_id, ctx, step.gamma))

    def ask_ahead(self, step: LazyStep) -> None:
        """With decision tables: have the sender thread ask for a new table when the held
        one is due for a refresh or will not answer ``step`` (whose context it then builds);
        nothing without them."""
        if self._use_tables:
            self._refresh_if_due(step)

    def gather_reports_with(self, gather: Callable[[], None]) -> None:
        """``gather`` queues reports a caller deferred (:meth:`ran`, :meth:`report`): run
        before each batch of reports is taken to be sent, by the thread sending it."""
        self._gather = gather

    def flush_soon(self) -> None:
        """Have the sender thread send the queued reports without asking for a table
        (unless a table request, which carries them, is under way)."""
        if not self._refreshing:
            self._flush_wanted = True
            self._refresh_wanted.set()

    def _ask_ahead_locked(self, ctx: StepContext) -> None:
        """Send ``ctx`` and keep its pending answer, stamped with the policy epoch."""
        future = self._send(ctx)
        self._prefetched = (ctx, future, self._policy_epoch) if future is not None else None

    def take(self, ctx: StepContext, report_ran: bool = True) -> GammaDecision:
        """The prefetched decision for this step's batch size, else a fresh decide (also
        when a policy notice came after the prefetch was sent: its answer may be stale).
        With decision tables, not ``report_ran``: a step answered from a table is not
        reported; the caller does (:meth:`ran`), as for :meth:`take_from_table`."""
        if self._use_tables:
            return self._take_from_table(ctx, report_ran)
        with self._prefetch_lock:
            prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None:
            asked, future, epoch = prefetched
            if (asked.engine_id, asked.step_index) != (ctx.engine_id, ctx.step_index):
                reason = "step"
            elif ctx.batch_size not in (asked.batch_size, *asked.candidate_batch_sizes):
                reason = "batch_size"
            elif epoch != self._policy_epoch:
                reason = "policy"
            else:
                decision = self._resolve(ctx, future, asked.batch_size)
                if decision is not None:
                    self.stats.prefetch_hits += 1
                    return decision
                reason = "answer"
            if reason != "answer":
                future.add_done_callback(self._count_late)
            self.stats.prefetch_misses += 1
            self.stats.prefetch_miss_reasons[reason] += 1
        return self.decide(ctx)

    def discard_prefetch(self) -> None:
        """Forget a prefetched decision that will not be taken (e.g. the engine idled)."""
        if self._use_tables:
            return  # a table is not for one step
        with self._prefetch_lock:
            prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None:
            prefetched[1].add_done_callback(self._count_late)

    def report(self, outcome: StepOutcome) -> None:
        """Queue a step's outcome; it rides on the next request (or goes alone)."""
        if not outcome.decision_id:
            return  # a fallback decision: the sidecar never saw it
        if self._use_tables:
            reports = self._reports
            reports.outcome(outcome)  # goes with the next table request
            if reports.outcomes >= REPORT_BATCH_OUTCOMES:
                self.flush_soon()  # or alone, by the sender thread
            return
        with self._lock:
            older, self._pending_outcome = self._pending_outcome, outcome
        if older is not None:
            self._send_outcome_only(older)

    def flush(self) -> None:
        """Send a queued outcome now, without asking for a decision."""
        if self._use_tables:
            self._flush_reports()
            return
        with self._lock:
            outcome, self._pending_outcome = self._pending_outcome, None
        if outcome is not None:
            self._send_outcome_only(outcome)

    def close(self) -> None:
        if self._use_tables:
            # The last batch is applied before the stream closes under it.
            future = self._flush_reports()
            if future is not None:
                try:
                    future.result(timeout=CLOSE_FLUSH_S)
                except Exception:  # closing anyway: the sidecar may be gone
                    log.debug("nightjar: the last report batch got no answer")
        self.flush()
        self._closed.set()
        self._broken.set()
        self._refresh_wanted.set()  # the sender thread sees _closed and ends
        if self._transport is not None:
            self._transport.close()
        self._reconnector.join(timeout=2)
        self._stop_watching_unary()
        # gRPC's connectivity poller notices within one poll period (0.2 s) that the last
        # subscriber left; closing the channel under it makes it raise in its thread.
        linger = self._ready_wait_ended + POLLER_PERIOD_S - time.monotonic()
        if linger > 0:
            time.sleep(linger)
        self._channel.close()

    def __enter__(self) -> NightjarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------

    def _request(self, ctx: StepContext | None) -> policy_pb2.StepRequest:
        with self._lock:
            outcome, self._pending_outcome = self._pending_outcome, None
            ran = ""
            if ctx is not None:
                ran, self._ran_decision_id = self._ran_decision_id, ""
        request = policy_pb2.StepRequest(seq=next(self._seq))
        if outcome is not None:
            request.outcome.CopyFrom(wire.outcome_to_pb(outcome))
        if ctx is not None:
            request.context.CopyFrom(wire.context_to_pb(ctx))
            if ran:
                request.context.ran_decision_id = ran
        return request

    def _live_transport(self) -> _StreamTransport | _UnaryTransport | None:
        """The transport to send on, if it is up (the first request of a fresh client
        waits for it within the deadline)."""
        transport = self._transport
        if transport is None and not self._waited_for_first:
            self._waited_for_first = True
            self._first_connection.wait(self.config.deadline_s)
            transport = self._transport
        return transport if transport is not None and transport.alive else None

    def _send(self, ctx: StepContext) -> PendingReply | None:
        transport = self._live_transport()
        if transport is None:
            return None
        request = self._request(ctx)
        future = transport.send(request)
        future.names_ran = request.context.ran_decision_id
        future.add_done_callback(self._on_reply)
        return future

    def _on_reply(self, future: PendingReply) -> None:
        """Every reply, including prefetched decisions that are discarded and late ones:
        keep its memory directive (the sidecar issues each directive once), and name again
        what a rejected request named as run."""
        try:
            reply = future.result(timeout=0)
        except SidecarRejected as exc:
            self._rename_ran(future, exc.code)
            return
        except Exception:
            return
        if reply.HasField("error"):
            self._rename_ran(future, reply.error.code)
            return
        if reply.HasField("decision") and reply.decision.HasField("memory_directive"):
            directive = wire.directive_from_pb(reply.decision.memory_directive)
            if directive.action:
                with self._lock:
                    self._directives.append(directive)

    def _rename_ran(self, future: PendingReply, code: int) -> None:
        """The sidecar rejected ``future``'s request: the next request names the decision
        it named as run (once, from whichever of the waiter and the reply's callback gets
        here first). Nothing of a rejected request is applied; unnamed, that tentative
        decision is dropped with its set, its outcome two steps later is unknown and
        rejects that request in turn, and so on: one bad outcome made every other step
        fall back for good. A superseded request (ABORTED) was applied."""
        if code == grpc.StatusCode.ABORTED.value[0]:
            return
        with self._lock:
            ran, future.names_ran = future.names_ran, ""
            if ran and not self._ran_decision_id:  # unless a newer one is to be named
                self._ran_decision_id = ran

    def take_directives(self) -> list[MemoryDirective]:
        """Memory directives received since the last call, oldest first."""
        if not self._directives:  # the usual step: no lock on the engine's thread
            return []
        with self._lock:
            directives, self._directives = self._directives, []
        return directives

    def _send_outcome_only(self, outcome: StepOutcome) -> None:
        transport = self._transport
        if transport is None or not transport.alive:
            return
        request = policy_pb2.StepRequest(seq=next(self._seq), outcome=wire.outcome_to_pb(outcome))
        transport.send(request).add_done_callback(self._check_ack)

    def _check_ack(self, future: PendingReply) -> None:
        try:
            reply = future.result(timeout=0)
        except Exception:
            return
        if reply.HasField("error"):
            self.stats.rejected_reports += 1
            log.warning("sidecar rejected an outcome: %s", reply.error.message)

    def _resolve(
        self, ctx: StepContext, future: PendingReply | None, asked_batch_size: int
    ) -> GammaDecision | None:
        """The decision for ``ctx.batch_size`` from the reply to a request whose context
        had ``asked_batch_size``; None when the reply has no answer for that size (a
        sidecar without candidate support answers only the asked size)."""
        self.stats.decisions += 1
        reply = self._await(ctx, future)
        if isinstance(reply, GammaDecision):
            return reply
        assert future is not None  # it answered
        if reply.HasField("error"):
            log.warning("sidecar rejected a step context: %s", reply.error.message)
            self._rename_ran(future, reply.error.code)
            return self._fall_back(ctx, "rejected")
        chosen = _pick(reply.decision, ctx.batch_size, asked_batch_size)
        if chosen is None:
            self.stats.decisions -= 1  # the caller asks again
            return None
        self.stats.sidecar_decisions += 1
        if chosen.tentative:
            with self._lock:
                self._ran_decision_id = chosen.decision_id
        decision = wire.decision_from_pb(chosen, candidates=False)
        return GammaDecision(gamma=decision.gamma, source="sidecar", decision=decision)

    # -- decision tables ------------------------------------------------------------------

    def _take_from_table(self, ctx: StepContext, report_ran: bool = True) -> GammaDecision:
        """The held table's entry for this step; on a miss a table asked for now, waited
        for up to the deadline, else the fallback."""
        self.stats.decisions += 1
        taken = self._tables.take(ctx, time.monotonic())
        if isinstance(taken, str):
            # Whether the table that would have answered was on its way: a refresh asked
            # for too late, or one answered too late.
            self.stats.table_misses[f"{taken} (refreshing)" if self._refreshing else taken] += 1
            waited = self._wait_for_table(ctx)
            if isinstance(waited, GammaDecision):
                return waited
            taken = waited
        self.stats.sidecar_decisions += 1
        if report_ran:
            self.ran(taken, ctx)
        return GammaDecision(taken.gamma, "sidecar", table_step=taken)

    def _wait_for_table(self, ctx: StepContext) -> TableStep | GammaDecision:
        """Ask for a table for ``ctx`` now and take its entry, within the deadline. One
        such request is in flight per engine: a miss while the last one is unanswered
        waits for that one instead of queueing another behind it (a sidecar behind its
        queue would answer each late, leaving every next step missing and asking again).

        The sender thread gathers the reports, builds and sends the request (the engine's
        thread, which waits for the answer anyway, only hands it the step); the reply's
        callback installs the table before this thread wakes."""
        if self._miss_request is not None and not self._miss_request.done:
            return self._wait_for_outstanding(ctx, self._miss_request)
        if self._live_transport() is None:  # (a fresh client's first waits for one)
            return self._fall_back(ctx, "disconnected")
        reply_to = self._miss_request = PendingReply()
        self._miss_step = (ctx, reply_to)
        self._refresh_wanted.set()
        reply = self._await(ctx, reply_to)
        if isinstance(reply, GammaDecision):
            return reply
        if reply.HasField("error"):
            if reply.error.code == grpc.StatusCode.ABORTED.value[0]:
                return self._fall_back(ctx, "superseded")  # its reports were applied
            log.warning("sidecar rejected a step context: %s", reply.error.message)
            return self._fall_back(ctx, "rejected")
        if not reply.HasField("table"):
            self._tables_unsupported()
            if not reply.HasField("decision"):
                return self._fall_back(ctx, "answer")
            self.stats.sidecar_decisions += 1
            decision = wire.decision_from_pb(reply.decision, candidates=False)
            return GammaDecision(gamma=decision.gamma, source="sidecar", decision=decision)
        taken = self._tables.take(ctx, time.monotonic())
        if isinstance(taken, str):  # the answer does not fit the step (cannot happen)
            return self._fall_back(ctx, "answer")
        return taken

    def _wait_for_outstanding(
        self, ctx: StepContext, future: PendingReply
    ) -> TableStep | GammaDecision:
        """Within the deadline, the table the last miss asked for (installed by the
        reply's callback), if it fits ``ctx``."""
        try:
            future.result(timeout=self.config.deadline_s)
        except TimeoutError:
            return self._fall_back(ctx, "deadline")
        except Exception:  # rejected or lost: that miss counted it already
            return self._fall_back(ctx, "unavailable")
        taken = self._tables.take(ctx, time.monotonic())
        return self._fall_back(ctx, "deadline") if isinstance(taken, str) else taken

    def _refresh_if_due(self, step: AheadStep, always: bool = False) -> None:
        """Have the sender thread ask for a new table if the held one is due (``always``:
        whatever the held one; either way not while a refresh is in flight)."""
        config = self.config
        self._next_step = step
        if self._refreshing:
            return
        if not always and not refresh_due(
            self._tables.held,
            step.batch_size,
            step.speculation_off,
            time.monotonic(),
            config.table_refresh_steps,
            config.table_refresh_ms,
        ):
            return
        self._hand_over(step)
        self._refresh_wanted.set()

    def _hand_over(self, step: AheadStep) -> None:
        """Give the sender thread the step to refresh the table for; a refresh is now
        under way (until its reply, or until it could not be sent)."""
        with self._send_lock:
            self._refresh_step = step
        self._refreshing = True

    def _flush_reports(self) -> PendingReply | None:
        self._gather()
        if not len(self._reports):
            return None
        return self._send_batch(None, want_table=False)

    def _send_loop(self) -> None:
        """The sender thread: builds and sends the refresh requests, off the engine's
        thread (one wake-up per refresh instead of one queue hand-off per step). It also
        refreshes a table that aged past ``table_refresh_ms`` while the engine was in a
        step: a step longer than a table's validity (seconds of prefill on a CPU, a
        stalled GPU) would otherwise find it expired and wait a round trip."""
        period = self.config.table_refresh_ms / 1000
        while True:
            asked = self._refresh_wanted.wait(timeout=period)
            if self._closed.is_set():
                return
            miss, self._miss_step = self._miss_step, None
            if miss is not None:  # it carries the queued reports, and supersedes a refresh
                self._flush_wanted = False
                self._send_miss(*miss)  # (also to a sidecar found meanwhile to send none)
                continue
            if not self._use_tables:
                continue
            if asked and self._flush_wanted and not self._refreshing:
                self._flush_wanted = False
                self._flush_reports()
                continue
            self._flush_wanted = False
            if not asked:
                step = self._outlived_table()
                if step is None:
                    continue
                self._hand_over(step)
            future = self._send_batch(None, want_table=True, refresh=True)
            if future is None:
                self._refreshing = False
            else:
                self.stats.refresh_requests += 1

    def _send_miss(self, ctx: StepContext, reply_to: PendingReply) -> None:
        """Send the table request of a step the held table could not answer; its reply
        (or why there is none) goes to ``reply_to``, which the engine's thread awaits."""
        future = self._send_batch(ctx, want_table=True)
        if future is None:
            reply_to.resolve(error=NotSent("no connection to the sidecar"))
            return
        self.stats.miss_requests += 1
        future.relay_to(reply_to)

    def _outlived_table(self) -> AheadStep | None:
        """The step the engine will ask for next, if the held table has served, aged past
        the refresh period since, and no refresh is under way (a new table is not used
        until that step: at most one such refresh per long step, none while an engine
        idles on an unused table)."""
        held, step = self._tables.held, self._next_step
        if self._refreshing or held is None or held.started is None or step is None:
            return None
        if held.age_ms(time.monotonic()) < self.config.table_refresh_ms:
            return None
        return step

    def _send_batch(
        self, ctx: StepContext | None, want_table: bool, refresh: bool = False
    ) -> PendingReply | None:
        """Send the queued reports, with ``ctx`` (and a table asked for it) if given;
        ``refresh``: with the step handed to the sender instead (nothing if none is)."""
        transport = self._live_transport()
        if transport is None:
            return None
        with self._send_lock:
            if refresh:
                if self._refresh_step is None:
                    return None
                ctx = self._refresh_step.context()
            elif self._refresh_step is not None:
                self._refreshing = False  # a refresh handed over and not sent: moot now
            self._refresh_step = None
            request = policy_pb2.StepRequest(seq=next(self._seq), want_table=want_table)
            self._gather()
            ran, outcomes = self._reports.drain(MAX_BATCHED)
            request.ran_steps.extend(wire.ran_step_to_pb(step) for step in ran)
            request.outcomes.extend(wire.outcome_to_pb(outcome) for outcome in outcomes)
            if ctx is not None:
                request.context.CopyFrom(wire.context_to_pb(_without_candidates(ctx)))
            future = transport.send(request)
        seq = request.seq
        future.add_done_callback(lambda done: self._on_table_reply(done, seq, refresh))
        return future

    def _on_table_reply(self, future: PendingReply, seq: int, refresh: bool) -> None:
        """Every reply to a table request, on time or late: hold its table (unless a
        newer one is held), keep its memory directive; a refresh's ends the refresh."""
        if refresh:
            self._refreshing = False
        try:
            reply = future.result(timeout=0)
        except Exception:
            return
        if reply.skipped:
            self.stats.rejected_reports += reply.skipped
            log.warning(
                "sidecar skipped %d reported step(s) or outcome(s): %s",
                reply.skipped,
                reply.skipped_reason,
            )
        if reply.HasField("table"):
            self._install(reply.table, seq)
        elif reply.HasField("error"):
            if reply.error.code != grpc.StatusCode.ABORTED.value[0]:  # ABORTED: applied
                self.stats.rejected_reports += 1
                log.warning("sidecar rejected a report batch: %s", reply.error.message)
        elif reply.HasField("decision"):
            self._tables_unsupported()

    def _install(self, message: policy_pb2.GammaTable, seq: int) -> None:
        table = wire.table_from_pb(message)
        if not self._tables.install(table, seq):
            return
        self.stats.tables += 1
        if table.memory_directive.action:
            with self._lock:
                self._directives.append(table.memory_directive)

    def _tables_unsupported(self) -> None:
        """The sidecar answered a table request with a decision: it predates v1.7."""
        if self._use_tables:
            self._use_tables = False
            log.info("nightjar: the sidecar sends no decision tables; one decision per step")

    def _await(
        self, ctx: StepContext, future: PendingReply | None
    ) -> policy_pb2.StepReply | GammaDecision:
        """The reply to ``ctx``'s request within the deadline, else the fallback (why:
        disconnected, deadline, rejected, unavailable)."""
        if future is None:
            return self._fall_back(ctx, "disconnected")
        try:
            return future.result(timeout=self.config.deadline_s)
        except TimeoutError:
            future.add_done_callback(self._count_late)
            return self._fall_back(ctx, "deadline")
        except NotSent:
            return self._fall_back(ctx, "disconnected")
        except SidecarRejected as exc:
            log.warning("%s", exc)
            self._rename_ran(future, exc.code)  # before the next request is built
            return self._fall_back(ctx, "rejected")
        except ConnectionError:
            return self._fall_back(ctx, "unavailable")

    def _fall_back(self, ctx: StepContext, reason: str) -> GammaDecision:
        self.stats.fallbacks[reason] += 1
        gamma = self._fallback.gamma_for_step(ctx)
        return GammaDecision(gamma=gamma, source="fallback", fallback_reason=reason)

    def _count_late(self, future: PendingReply) -> None:
        if not future.failed:
            self.stats.late_replies += 1

    def _on_policy_notice(self, version: str) -> None:
        """On the stream's reader thread. The first notice (on the first stream) confirms
        the version that decided the answers so far: no change. After a change a kept
        answer is asked for again, so that the step after a swap (often the first after an
        idle gap: operators swap while the engine waits) still finds its answer."""
        self.stats.policy_notices += 1
        changed = self._policy_version is not None and version != self._policy_version
        self._policy_version = version
        log.debug("nightjar: sidecar policy version %s", version)
        if not changed:
            return
        if self._use_tables:
            held = self._tables.held
            if held is not None and held.table.policy_version != version:
                self._tables.void()
                with self._send_lock:
                    self._refresh_step = self._next_step
                if self._next_step is not None:
                    self._refresh_wanted.set()  # a table of the new policy, before the step
            return
        with self._prefetch_lock:
            self._policy_epoch += 1
            if self._prefetched is not None:
                self._ask_ahead_locked(self._prefetched[0])

    def _on_broken(self, transport: _StreamTransport) -> None:
        if not self._closed.is_set():
            log.warning("lost the sidecar stream; falling back and reconnecting")
        self._connection_lost()

    def _connection_lost(self) -> None:
        """The sidecar went away: its tables go with it (a restarted one does not know
        them, and the engine falls back until one answers), the reports too."""
        self._tables.forget()
        self._reports.clear()
        self._broken.set()

    def _reconnect_loop(self) -> None:
        """Keep one live transport; reopen it with backoff whenever it breaks."""
        backoff = 0.05
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
                if self._transport is None:
                    self._warn_unreachable()
                backoff = min(backoff * 2, 1.0)
                continue
            # Cleared before the new transport exists: a stream that breaks at once (a
            # sidecar still starting, or the channel's READY left over from before a kill)
            # sets it again, and is reopened instead of being lost.
            self._broken.clear()
            if self.config.use_stream:
                transport: _StreamTransport | _UnaryTransport = _StreamTransport(
                    self._channel, self._on_broken, self._on_policy_notice
                )
            else:
                transport = _UnaryTransport(self._channel, self.config.deadline_s)
            if self._transport is not None:
                self.stats.reconnects += 1
                log.info("nightjar: reconnected to the sidecar at %s", self.config.target)
                # A restarted sidecar does not know the old decision ids.
                with self._lock:
                    self._pending_outcome = None
                    self._ran_decision_id = ""
                self._tables.forget()
                self._reports.clear()
            else:
                self._log_first_connection()
            self._transport = transport
            self._first_connection.set()
            backoff = 0.05
            if not self.config.use_stream:
                self._watch_unary()

    def _warn_unreachable(self) -> None:
        """Once, at start: why the sidecar cannot be reached (the engine meanwhile runs on
        the fallback table, which is easy to miss: it still serves)."""
        if self._warned_unreachable:
            return
        error = connect_error(self.config.target)
        if error is None and time.monotonic() - self._started < UNREADY_WARNING_S:
            return  # it accepts connections: give gRPC a moment before complaining
        self._warned_unreachable = True
        if error is None:
            reason = f"it accepts connections but gave no gRPC answer in {UNREADY_WARNING_S} s"
            if self.config.tls is not None:
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
            self.config.target,
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
            self.config.target,
            waited,
        )

    def _watch_unary(self) -> None:
        """Unary mode has no stream to break: watch the channel's connectivity instead."""

        def on_change(state: grpc.ChannelConnectivity) -> None:
            if (
                state
                in (
                    grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                    grpc.ChannelConnectivity.SHUTDOWN,
                )
                and self._transport is not None
            ):
                self._transport.alive = False
                self._stop_watching_unary()
                self._connection_lost()

        self._unary_watch = on_change
        self._channel.subscribe(on_change, try_to_connect=True)

    def _stop_watching_unary(self) -> None:
        watch, self._unary_watch = self._unary_watch, None
        if watch is not None:
            self._channel.unsubscribe(watch)
            self._ready_wait_ended = time.monotonic()  # its poller leaves at its next wake-up


def _without_candidates(ctx: StepContext) -> StepContext:
    if not ctx.candidate_batch_sizes:
        return ctx
    return dataclasses.replace(ctx, candidate_batch_sizes=())


def _pick(
    decision: policy_pb2.Decision, batch_size: int, asked_batch_size: int
) -> policy_pb2.Decision | None:
    """The decision (or candidate) made for ``batch_size``; a sidecar older than v1.2 sets
    no batch_size, its decision is for the asked one."""
    if (decision.batch_size or asked_batch_size) == batch_size:
        return decision
    for candidate in decision.candidates:
        if candidate.batch_size == batch_size:
            return candidate
    return None


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
