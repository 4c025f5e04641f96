"""Fail-open client of the Nightjar sidecar, used by the vLLM plugin and the simulator.

The engine must never wait on the sidecar longer than a step can afford:

* a step is answered from the newest table of γ per batch size the sidecar sent
  (nightjar_common/tables.py), without a round trip; the steps run and their outcomes go
  to the sidecar in batches, from a sender thread, which also asks for the next table
  before the held one is due: the engine's thread builds no protobuf and waits on nothing;
* a step the held table cannot answer (a miss) asks for a table and waits for it up to
  the deadline (default 2 ms); past it, or while the sidecar is unreachable, γ comes from
  a local fallback table (vLLM's dynamic-SD shape) and the fallback is counted, like
  Envoy's ``failure_mode_allowed``.

The parts: the transport (sidecar_stream.py), the connection's supervision
(sidecar_connection.py) and, here, the table protocol behind the public client.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import grpc
from nightjar_proto.v1 import policy_pb2

from nightjar_common import wire
from nightjar_common.fallback import DEFAULT_SCHEDULE, BatchSizeTable
from nightjar_common.sidecar_connection import SidecarConnection
from nightjar_common.sidecar_stream import NotSent, PendingReply
from nightjar_common.tables import (
    AheadStep,
    NextStep,
    ReportBatch,
    ReportSource,
    TableCache,
    TableStep,
    refresh_due,
)
from nightjar_common.tls import ClientTls
from nightjar_common.types import BinType, MemoryDirective, RanStep, StepContext, StepOutcome
from nightjar_common.validation import MAX_BATCHED

log = logging.getLogger(__name__)

# How long closing waits for the sidecar to apply the last report batch.
CLOSE_FLUSH_S = 1.0
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
# A reply later than this is counted slow (ClientStats.slow_replies): fifty of the default
# 2 ms deadline.
SLOW_REPLY_S = 0.1
_ABORTED = grpc.StatusCode.ABORTED.value[0]


@dataclasses.dataclass(frozen=True, slots=True)
class ClientConfig:
    # "unix:/path/to/socket" or "host:port".
    target: str
    engine_id: str
    # Longest the engine waits for a table on a miss before falling back.
    deadline_s: float = 0.002
    # Local fail-open policy: [[start_bs, end_bs, gamma], ...].
    fallback_schedule: Sequence[Sequence[int]] = DEFAULT_SCHEDULE
    fallback_default_gamma: int = 0
    # How long to wait for a connection at start-up (0 = do not wait).
    connect_timeout_s: float = 0.0
    # TLS (mutual with a client certificate) to a host:port sidecar; None = plaintext.
    tls: ClientTls | None = None
    # Ask for a new table after this many steps from one, or once it is this old; the
    # answer arrives while the engine runs on the held one.
    table_refresh_steps: int = TABLE_REFRESH_STEPS
    table_refresh_ms: float = TABLE_REFRESH_MS
    # A simulation replaying a trace (nightjar-sim --sidecar), not an engine: tables age
    # on the simulation's clock (the time each step gives NightjarClient.decide), not the
    # wall clock, and each refresh, asked for a step ahead as an engine's is, is waited for
    # (up to the deadline). Every step then runs from the table an engine would hold if
    # the sidecar answered within its step, however fast the simulation steps, and a
    # replay with the same trace, seed and policy decides the same.
    replay: bool = False


@dataclasses.dataclass(slots=True)
class GammaDecision:
    """The γ to run and where it came from: a table's entry, or the fallback table."""

    gamma: int
    # "sidecar" or "fallback".
    source: str
    fallback_reason: str = ""
    table_step: TableStep | None = None

    @property
    def decision_id(self) -> str | None:
        return self.table_step.decision_id if self.table_step is not None else None

    @property
    def policy_name(self) -> str:
        """The policy that decided ("" for a fallback)."""
        return self.table_step.held.table.policy_name if self.table_step is not None else ""

    @property
    def bin_type(self) -> BinType | None:
        """How the sidecar chose γ (None for a fallback)."""
        taken = self.table_step
        if taken is None:
            return None
        table = taken.held.table
        return table.reason or (BinType.EXPLORE if taken.exploring else BinType.EXPLOIT)

    @property
    def request_gammas(self) -> tuple[tuple[str, int], ...]:
        """Per-request γ of a per-request policy (each capped at :attr:`gamma` by the
        engine); () = every request runs :attr:`gamma`."""
        return self.table_step.held.table.request_gammas if self.table_step is not None else ()

    @property
    def reads_request_signals(self) -> bool | None:
        """Whether the deciding policy reads per-request signals; None for a fallback
        (the local table says nothing of the sidecar's policy)."""
        if self.table_step is None:
            return None
        return self.table_step.held.table.reads_request_signals


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


@dataclasses.dataclass(slots=True)
class ClientStats:
    decisions: int = 0
    sidecar_decisions: int = 0
    fallbacks: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    rejected_reports: int = 0
    late_replies: int = 0
    reconnects: int = 0
    # Policy notices received (one when each stream opens, one per policy change).
    policy_notices: int = 0
    # Decision tables installed, and steps that found no usable entry, by why
    # (nightjar_common/tables.py); a miss waits up to the deadline for a table.
    tables: int = 0
    table_misses: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    # Table requests sent by steps that missed: one in flight at a time, later misses
    # wait for it (in a replay, its refreshes too: each is waited for).
    miss_requests: int = 0
    # Table requests sent ahead of need: the held table due for a refresh, or outlived
    # (one may follow a miss's unanswered request: the next step's, behind it).
    refresh_requests: int = 0
    # Table requests answered more than SLOW_REPLY_S after they were sent (the sidecar or
    # the stream held up: a step that waited on one fell back), and the longest any
    # answered request waited, seconds.
    slow_replies: int = 0
    longest_reply_s: float = 0.0

    @property
    def fallbacks_total(self) -> int:
        return sum(self.fallbacks.values())


class NightjarClient:
    """One engine's client: γ per step from decision tables, reports in batches."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.stats = ClientStats()
        self._fallback = BatchSizeTable(config.fallback_schedule, config.fallback_default_gamma)
        # Tables' ages: the wall clock, or a replay's simulated time (set by decide).
        self._replay_s = 0.0
        self._clock: Callable[[], float] = self._replay_time if config.replay else time.monotonic
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._directives: list[MemoryDirective] = []
        self._policy_version: str | None = None
        self._closed = threading.Event()
        # The held table and the report batch (the engine's thread uses both without a
        # lock); requests that drain the batch are sent under _send_lock, so the sidecar
        # applies batches in the order they were drained.
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
        self._miss_step: tuple[AheadStep, PendingReply] | None = None
        # Queues the reports a caller deferred before a batch is taken (defer_reports_to).
        self._deferred: ReportSource | None = None
        self._sender = threading.Thread(target=self._send_loop, name="nightjar-tables", daemon=True)
        self._sender.start()
        self._connection = SidecarConnection(
            config.target, config.tls, self._on_open, self._connection_lost, self._on_policy_notice
        )
        if config.connect_timeout_s > 0:
            self.wait_connected(config.connect_timeout_s)

    # -- public API -------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._connection.connected

    def wait_connected(self, timeout: float) -> bool:
        return self._connection.wait_connected(timeout)

    def decide(self, ctx: StepContext, now_s: float | None = None) -> GammaDecision:
        """γ for the step described by ``ctx``, reported as run (:meth:`take`); the next
        step is taken to be like this one, after this γ (:meth:`ask_ahead`). In a replay
        the step starts at ``now_s`` simulated seconds (the time its tables age by; None:
        the last step's), and the table asked for ahead is waited for: it is there for the
        next step, as an engine's is when the sidecar answers within its step."""
        if self.config.replay and now_s is not None:
            self._replay_s = now_s
        decision = self.take(ctx)
        self._refresh_if_due(NextStep(ctx, decision.gamma))
        return decision

    def take(self, ctx: StepContext, report_ran: bool = True) -> GammaDecision:
        """γ for the step described by ``ctx``: the held table's entry; on a miss a table
        asked for now and waited for up to the deadline, else the fallback. Not
        ``report_ran``: a step answered from a table is not reported; the caller does
        (:meth:`ran`)."""
        decision = self.take_step(NextStep(ctx))
        if report_ran and decision.table_step is not None:
            self.ran(decision.table_step, ctx)
        return decision

    def take_step(self, step: AheadStep) -> GammaDecision:
        """:meth:`take` for a step given by its batch size and speculation state, its
        context built only where a request carries it: by the sender thread for the table
        request of a miss (the caller's thread waits for the answer meanwhile), by the
        caller's thread only for a fallback. Nothing is reported (:meth:`ran`)."""
        self.stats.decisions += 1
        taken = self._tables.take_size(step.batch_size, step.speculation_off, self._clock())
        if isinstance(taken, str):
            # Whether the table that would have answered was on its way: a refresh asked
            # for too late, or one answered too late.
            self.stats.table_misses[f"{taken} (refreshing)" if self._refreshing else taken] += 1
            waited = self._wait_for_table(step)
            if isinstance(waited, GammaDecision):
                return waited
            taken = waited
        self.stats.sidecar_decisions += 1
        return GammaDecision(taken.gamma, "sidecar", table_step=taken)

    def take_from_table(self, batch_size: int, speculation_off: bool) -> TableStep | None:
        """The held table's entry for a step of ``batch_size`` (after a step at γ = 0 when
        ``speculation_off``), counted as a sidecar decision; None when it has none (then
        :meth:`take` the step: it asks for a table, waits, or falls back). Nothing is
        reported: the caller reports the step with :meth:`ran`, from any thread, in the
        order its steps ran (the engine's thread builds no context)."""
        taken = self._tables.take_size(batch_size, speculation_off, self._clock())
        if isinstance(taken, str):
            return None
        stats = self.stats
        stats.decisions += 1
        stats.sidecar_decisions += 1
        return taken

    def ran(self, step: TableStep, ctx: StepContext, gamma: int | None = None) -> None:
        """Report a step run from a table's entry, with its context and the γ the engine
        ran (the entry's unless given: less where the engine clamped it, 0 while its draft
        is away), unless its table came on a connection since lost: that sidecar is
        gone."""
        if self._tables.current(step.held):
            ran = step.gamma if gamma is None else gamma
            self._reports.ran(RanStep(step.decision_id, ctx, ran, step.exploited))

    def ask_ahead(self, step: AheadStep, always: bool = False) -> None:
        """Have the sender thread ask for a new table for ``step`` (whose context it then
        builds) when the held one is due for a refresh or will not answer it; ``always``:
        whatever the held one (the step after an idle gap: a held table that served before
        the gap may expire during it, while a new one's time starts at its first step)."""
        self._refresh_if_due(step, always)

    def defer_reports_to(self, source: ReportSource) -> None:
        """``source`` queues the reports a caller deferred (:meth:`ran`, :meth:`report`):
        asked to before each batch of reports is taken, by the thread sending it."""
        self._deferred = source

    def flush_soon(self) -> None:
        """Have the sender thread send the queued reports without asking for a table
        (unless a table request, which carries them, is under way)."""
        if not self._refreshing:
            self._flush_wanted = True
            self._refresh_wanted.set()

    def report(self, outcome: StepOutcome) -> None:
        """Queue a step's outcome; it goes with the next table request, or alone once
        REPORT_BATCH_OUTCOMES are queued."""
        if not outcome.decision_id:
            return  # a fallback decision: the sidecar never saw it
        reports = self._reports
        reports.outcome(outcome)
        if reports.outcomes >= REPORT_BATCH_OUTCOMES:
            self.flush_soon()

    def flush(self) -> None:
        """Send the queued reports now, without asking for a table."""
        self._send_batch(None)

    def take_directives(self) -> list[MemoryDirective]:
        """Memory directives received since the last call, oldest first."""
        if not self._directives:  # the usual step: no lock on the engine's thread
            return []
        with self._lock:
            directives, self._directives = self._directives, []
        return directives

    def close(self) -> None:
        # The last batch is applied before the stream closes under it.
        pending = self._send_batch(None)
        if pending is not None:
            try:
                pending.result(timeout=CLOSE_FLUSH_S)
            except Exception:  # closing anyway: the sidecar may be gone
                log.debug("nightjar: the last report batch got no answer")
        self._closed.set()
        self._refresh_wanted.set()  # the sender thread sees _closed and ends
        self._connection.close()

    def __enter__(self) -> NightjarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the engine's thread ------------------------------------------------------------

    def _wait_for_table(self, step: AheadStep) -> TableStep | GammaDecision:
        """Ask for a table for ``step`` now and take its entry, within the deadline. One
        such request is in flight per engine: a miss while the last one is unanswered
        waits for that one instead of queueing another behind it (a sidecar behind its
        queue would answer each late, leaving every next step missing and asking again)."""
        if self._miss_request is not None and not self._miss_request.done:
            return self._wait_for_outstanding(step, self._miss_request)
        asked = self._ask_now(step)
        if asked is not None:
            return asked
        taken = self._tables.take_size(step.batch_size, step.speculation_off, self._clock())
        if isinstance(taken, str):  # no table, or one that does not fit the step
            return self._fall_back(step, "answer")
        return taken

    def _ask_now(self, step: AheadStep) -> GammaDecision | None:
        """Ask for a table for ``step`` and wait for it, within the deadline: None once it
        is installed, else the fallback decision (and why)."""
        failed = self._request_table(step)
        return None if failed is None else self._fall_back(step, failed)

    def _request_table(self, step: AheadStep) -> str | None:
        """Ask for a table for ``step`` and wait for it, within the deadline: None once it
        is installed, else why not (a fallback reason).

        The sender thread builds the step's context, gathers the reports, builds and sends
        the request (the engine's thread, which waits for the answer anyway, only hands it
        the step); the reply's callback installs the table before this thread wakes."""
        if self._connection.live(self.config.deadline_s) is None:
            return "disconnected"
        reply_to = self._miss_request = PendingReply()
        self._miss_step = (step, reply_to)
        self._refresh_wanted.set()
        reply = self._await(reply_to)
        if isinstance(reply, str):
            return reply
        if reply.HasField("error"):
            if reply.error.code == _ABORTED:
                return "superseded"  # its reports were applied
            log.warning("sidecar rejected a step context: %s", reply.error.message)
            return "rejected"
        return None

    def _replay_time(self) -> float:
        """A replay's clock: the simulated time of its step."""
        return self._replay_s

    def _refresh_now(self, step: AheadStep) -> None:
        """A replay's refresh, asked for and waited for, so that it is there for the next
        step whatever the simulation's pace. One not answered is no fallback: the next
        step asks again if the held table cannot answer it."""
        self.stats.refresh_requests += 1
        self._request_table(step)

    def _wait_for_outstanding(
        self, step: AheadStep, pending: PendingReply
    ) -> TableStep | GammaDecision:
        """Within the deadline, the table the last miss asked for (installed by the
        reply's callback), if it fits ``step``."""
        try:
            pending.result(timeout=self.config.deadline_s)
        except TimeoutError:
            return self._fall_back(step, "deadline")
        except Exception:  # lost: that miss counted it already
            return self._fall_back(step, "unavailable")
        taken = self._tables.take_size(step.batch_size, step.speculation_off, self._clock())
        return self._fall_back(step, "deadline") if isinstance(taken, str) else taken

    def _refresh_if_due(self, step: AheadStep, always: bool = False) -> None:
        """Have the sender thread ask for a new table if the held one is due (``always``:
        whatever the held one; either way not while a refresh is in flight); a replay
        asks and waits (:meth:`_refresh_now`)."""
        config = self.config
        self._next_step = step
        if self._refreshing:
            return
        if not always and not refresh_due(
            self._tables.held,
            step.batch_size,
            step.speculation_off,
            self._clock(),
            config.table_refresh_steps,
            config.table_refresh_ms,
        ):
            return
        if config.replay:
            self._refresh_now(step)
            return
        self._hand_over(step)
        self._refresh_wanted.set()

    def _hand_over(self, step: AheadStep) -> None:
        """Give the sender thread the step to refresh the table for; a refresh is now
        under way (until its reply, or until it could not be sent)."""
        with self._send_lock:
            self._refresh_step = step
        self._refreshing = True

    def _await(self, pending: PendingReply) -> policy_pb2.StepReply | str:
        """The reply to a table request within the deadline, else why not (disconnected,
        deadline, unavailable)."""
        try:
            return pending.result(timeout=self.config.deadline_s)
        except TimeoutError:
            pending.add_done_callback(self._count_late)
            return "deadline"
        except NotSent:
            return "disconnected"
        except ConnectionError:
            return "unavailable"

    def _fall_back(self, step: AheadStep, reason: str) -> GammaDecision:
        """The fallback table's γ for ``step`` (its context built here, on the caller's
        thread: the table reads the engine's bounds from it)."""
        self.stats.fallbacks[reason] += 1
        gamma = self._fallback.gamma_for_step(step.context())
        return GammaDecision(gamma=gamma, source="fallback", fallback_reason=reason)

    def _count_late(self, pending: PendingReply) -> None:
        if not pending.failed:
            self.stats.late_replies += 1

    # -- the sender thread --------------------------------------------------------------

    def _send_loop(self) -> None:
        """The sender thread: builds and sends the table requests, off the engine's
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
                self._send_miss(*miss)
                continue
            if asked and self._flush_wanted and not self._refreshing:
                self._flush_wanted = False
                self._send_batch(None)
                continue
            self._flush_wanted = False
            if not asked:
                step = self._outlived_table()
                if step is None:
                    continue
                self._hand_over(step)
            if self._send_batch(None, refresh=True) is None:
                self._refreshing = False
            else:
                self.stats.refresh_requests += 1

    def _send_miss(self, step: AheadStep, reply_to: PendingReply) -> None:
        """Send the table request of a step the held table could not answer, its context
        built here; its reply (or why there is none) goes to ``reply_to``, which the
        engine's thread awaits."""
        pending = self._send_batch(step.context())
        if pending is None:
            reply_to.resolve(error=NotSent("no connection to the sidecar"))
            return
        self.stats.miss_requests += 1
        pending.relay_to(reply_to)

    def _outlived_table(self) -> AheadStep | None:
        """The step the engine will ask for next, if the held table has served, aged past
        the refresh period since, and no refresh is under way (a new table is not used
        until that step: at most one such refresh per long step, none while an engine
        idles on an unused table)."""
        held, step = self._tables.held, self._next_step
        if self._refreshing or held is None or held.started is None or step is None:
            return None
        if self.config.replay:  # a replay's steps ask for their tables themselves
            return None
        if held.age_ms(self._clock()) < self.config.table_refresh_ms:
            return None
        return step

    def _settle_deferred(self) -> None:
        if self._deferred is not None:
            self._deferred.settle()

    def _send_batch(self, ctx: StepContext | None, refresh: bool = False) -> PendingReply | None:
        """Send the queued reports, with ``ctx`` (a table asked for it) if given;
        ``refresh``: with the step handed to the sender instead (nothing if none is)."""
        if ctx is None and not refresh:
            self._settle_deferred()
            if not len(self._reports):
                return None  # nothing to send: no waiting for a connection either
        stream = self._connection.live(self.config.deadline_s)
        if stream is None:
            return None
        with self._send_lock:
            if refresh:
                if self._refresh_step is None:
                    return None
                ctx = self._refresh_step.context()
            elif self._refresh_step is not None:
                self._refreshing = False  # a refresh handed over and not sent: moot now
            self._refresh_step = None
            self._settle_deferred()
            ran, outcomes = self._reports.drain(MAX_BATCHED)
            if ctx is None and not ran and not outcomes:
                # Nothing to send: another thread's request took the reports first.
                return None
            request = policy_pb2.StepRequest(seq=next(self._seq))
            request.ran_steps.extend(wire.ran_step_to_pb(step) for step in ran)
            request.outcomes.extend(wire.outcome_to_pb(outcome) for outcome in outcomes)
            if ctx is not None:
                request.context.CopyFrom(wire.context_to_pb(ctx))
            sent = time.monotonic()
            pending = stream.send(request)
        seq = request.seq
        pending.add_done_callback(lambda done: self._on_table_reply(done, seq, refresh, sent))
        return pending

    # -- the stream's reader thread -----------------------------------------------------

    def _on_table_reply(self, pending: PendingReply, seq: int, refresh: bool, sent: float) -> None:
        """Every reply to a table request, on time or late: hold its table (unless a
        newer one is held), keep its memory directive; a refresh's ends the refresh. How
        long it took is counted (``sent``: time.monotonic() when the request was sent)."""
        if refresh:
            self._refreshing = False
        try:
            reply = pending.result(timeout=0)
        except Exception:
            return
        self._count_wait(time.monotonic() - sent)
        if reply.skipped:
            self.stats.rejected_reports += reply.skipped
            log.warning(
                "sidecar skipped %d reported step(s) or outcome(s): %s",
                reply.skipped,
                reply.skipped_reason,
            )
        if reply.HasField("table"):
            self._install(reply.table, seq)
        elif reply.HasField("error") and reply.error.code != _ABORTED:  # ABORTED: applied
            self.stats.rejected_reports += 1
            log.warning("sidecar rejected a report batch: %s", reply.error.message)

    def _count_wait(self, waited: float) -> None:
        stats = self.stats
        if waited > SLOW_REPLY_S:
            stats.slow_replies += 1
        if waited > stats.longest_reply_s:
            stats.longest_reply_s = waited

    def _install(self, message: policy_pb2.GammaTable, seq: int) -> None:
        table = wire.table_from_pb(message)
        if not self._tables.install(table, seq):
            return
        self.stats.tables += 1
        if table.memory_directive.action:
            with self._lock:
                self._directives.append(table.memory_directive)

    def _on_policy_notice(self, version: str) -> None:
        """The first notice (on the first stream) confirms the version that decided the
        tables so far: no change. After a change the held table of the old policy is
        dropped and one of the new policy asked for, so that the next step (often the
        first after an idle gap: operators swap while the engine waits) finds it; unless
        the engine is waiting on a miss, whose table the new policy decides."""
        self.stats.policy_notices += 1
        changed = self._policy_version is not None and version != self._policy_version
        self._policy_version = version
        log.debug("nightjar: sidecar policy version %s", version)
        if not changed:
            return
        held = self._tables.held
        if held is not None and held.table.policy_version != version:
            self._tables.void()
            miss = self._miss_request
            if miss is not None and not miss.done:
                # Its reply follows this notice on the stream, so the new policy decides
                # it; a refresh sent now would supersede it, and the engine waiting on it
                # would fall back.
                return
            with self._send_lock:
                self._refresh_step = self._next_step
            if self._next_step is not None:
                self._refresh_wanted.set()

    # -- the connection's thread --------------------------------------------------------

    def _on_open(self, reconnected: bool) -> None:
        if reconnected:
            self.stats.reconnects += 1
            self._connection_lost()  # a restarted sidecar does not know the old decision ids

    def _connection_lost(self) -> None:
        """The sidecar went away: its tables go with it (a restarted one does not know
        them, and the engine falls back until one answers), the reports too."""
        self._tables.forget()
        self._reports.clear()
