"""The engine-side control loop, free of vLLM types: step views in, γ and outcomes out.

vLLM drafts the γ chosen when step k is scheduled at the end of step k and verifies
those drafts in step k+1, so decision k is reported with what step k+1 verified
(drafted, accepted + bonus tokens) and step k+1's busy time (decision → update). When
the engine runs out of requests, or a step samples nothing, the pending decision is
dropped: nothing verified its drafts there.

γ is decided once the step's batch is known (at the end of vLLM's schedule call).
Right after, the decision for step k+1 is requested, so the round trip overlaps step
k's forward pass and step k+1 normally finds the answer waiting. Step k+1's batch is
not known yet (requests finish, waiting ones join), so the request asks for the batch
sizes it can plausibly have (:func:`candidate_batch_sizes`); the sidecar decides each
tentatively and learns only from the one that ran, which the client names with its
next request. When the batch moved outside that window or the answer is late, the
client asks again and waits at most its deadline, then falls back to the local table.

With decision tables (nightjar.v1.7, the client's default) the client answers each step
from the table of γ per batch size the sidecar sent last and reports in batches; the
request for step k+1 then only asks for a new table when the held one is due.

The engine's thread does as little as a step needs: a step the held table answers is
looked up and journaled (one tuple), a finished step journaled; the bookkeeping —
contexts, the steps run and their outcomes for the sidecar, pairing each decision with
the step that verified it, counters — is settled from the journal by whichever thread
next needs it: the client's sender just before it sends a report batch, the telemetry
thread, or the engine's own thread on the steps that must ask the sidecar anyway. After a
forward pass has evicted the CPU caches, each object built on the engine's thread costs
microseconds (docs/BENCHMARKS.md, "The engine thread's CPU").
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from nightjar_common.client import (
    REPORT_BATCH_OUTCOMES,
    ClientConfig,
    GammaDecision,
    NightjarClient,
)
from nightjar_common.fallback import DEFAULT_SCHEDULE
from nightjar_common.tables import LazyStep, TableStep
from nightjar_common.types import (
    EngineRuntime,
    MemoryDirective,
    RequestSignals,
    StepContext,
    StepOutcome,
)
from nightjar_common.validation import MAX_CANDIDATES
from vllm_client_patch.config import PluginConfig
from vllm_client_patch.metrics import PluginMetrics, Totals
from vllm_client_patch.quantiles import DurationHistogram

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 1.0
# Per-step samples queued for the histograms: counted on the engine's thread only when
# no telemetry thread has counted them for this many steps (none runs: no stats file, no
# metrics).
MAX_QUEUED_SAMPLES = 8192
# Batch sizes asked for ahead of a step besides the current one: as many as the sidecar
# accepts (validation.MAX_CANDIDATES). Requests admitted together finish together (a
# benchmark's fixed output length, a burst), so the batch may drop by many at once; a
# backlog being admitted grows it by what a step's token budget holds. Both go on for
# several steps at a similar pace, so the window follows the last step's change: joins
# centred on the last growth while requests wait, drops centred on the last shrink while
# the batch drains, else as many drops as the joins leave room for (docs/VLLM_PLUGIN.md,
# "Asking ahead"). Every size given to one side is taken from the other: CANDIDATE_WINDOW
# is the least either side keeps, CANDIDATE_JOINS the most joins asked for while no backlog
# is admitted (more waiting than that is a backlog).
CANDIDATE_WINDOW = 2
CANDIDATE_JOINS = 8
# Around a change of c in the last step: c − BELOW … c + (the rest of the window); larger
# covers a run of changes that slows down, at the price of one that speeds up.
BELOW = 6


def candidate_batch_sizes(batch_size: int, waiting: int, change: int = 0) -> tuple[int, ...]:
    """Other batch sizes the next step may have (StepContext.candidate_batch_sizes).

    ``change``: how much the batch grew in the last step (negative: it shrank)."""
    if waiting > CANDIDATE_JOINS or (change > CANDIDATE_WINDOW and waiting > 0):
        drops = CANDIDATE_WINDOW
        first = max(1, change - BELOW)
        joins = range(first, first + MAX_CANDIDATES - drops)
    else:
        joins = range(1, max(CANDIDATE_WINDOW, min(waiting, CANDIDATE_JOINS)) + 1)
        drops = MAX_CANDIDATES - len(joins)
    first_drop = max(1, -change - BELOW) if change < -CANDIDATE_WINDOW else 1
    smaller = (batch_size - d for d in range(first_drop, first_drop + drops))
    return (*sorted(b for b in smaller if b >= 1), *(batch_size + j for j in joins))


@dataclasses.dataclass(slots=True)
class EngineView:
    """What the scheduler knows at a step boundary."""

    # Requests that sample in the step (decodes and completing prefills, not partial
    # prefill chunks): they draft after it and verify in the next step.
    batch_size: int
    waiting: int
    free_kv_blocks: int
    total_kv_blocks: int
    max_gamma: int
    draft_resident: bool = True
    # Tokens in the drafting requests' contexts, and prefill tokens sharing the step.
    context_tokens: int = 0
    prefill_tokens: int = 0
    # Draft passes the drafter runs even at γ = 0 (StepContext.min_draft_passes).
    min_draft_passes: int = 0
    # The drafting requests' ids, given while the policy reads per-request signals
    # (GammaController.wants_request_ids).
    request_ids: tuple[str, ...] = ()


@dataclasses.dataclass(slots=True)
class VerifiedStep:
    """What a finished step verified, summed over its requests."""

    drafted_tokens: int
    accepted_tokens: int
    # Accepted + bonus tokens of every request that sampled in the step.
    generated_tokens: int
    # Accepted draft tokens of each request that verified drafts.
    request_accepts: tuple[int, ...] = ()
    # Their request ids, in the same order (given while the policy reads them).
    request_ids: tuple[str, ...] = ()


class HookTime(NamedTuple):
    """Wall and engine-thread CPU seconds: a point in time (:meth:`now`) or a span
    (:meth:`elapsed`). Where the wall time of the hook far exceeds its CPU time, the thread
    was waiting, not working: for the GIL (the engine process's other Python threads) or
    for a core. A tuple: taken several times a step on the engine's thread."""

    wall: float = 0.0
    cpu: float = 0.0

    @classmethod
    def now(cls) -> HookTime:
        return cls(time.perf_counter(), time.thread_time())

    def elapsed(self) -> HookTime:
        """The span from this point to now."""
        return HookTime(time.perf_counter() - self.wall, time.thread_time() - self.cpu)


@dataclasses.dataclass(slots=True)
class _InFlight:
    decision: GammaDecision
    started: float
    # Prefill computed in the step: reported with the outcome whose time is this step's
    # (the previous decision's, whose drafts this step verifies).
    prefill_tokens: int = 0


# Journal records (GammaController._journal), appended by the engine's thread in step
# order. A decided step: its view, step index, the γ the step before ran, its context
# where one was built (else None), the table entry it took (not reported yet) or the
# client's decision (reported), the γ it runs, when its hook began.
_Decided = tuple[
    EngineView, int, "int | None", "StepContext | None", "TableStep | GammaDecision", int, float
]
# A finished step: what it verified, when its hook began. IDLE: the engine ran dry.
_Ended = tuple[VerifiedStep, float]
IDLE = "idle"


class GammaController:
    """One per engine: asks the sidecar for γ each step and reports what happened."""

    def __init__(
        self,
        config: PluginConfig,
        fallback_table: tuple[tuple[int, int, int], ...] | None = None,
        client_factory: Callable[[ClientConfig], NightjarClient] = NightjarClient,
        metrics: PluginMetrics | None = None,
        runtime: EngineRuntime | None = None,
    ) -> None:
        """``metrics``: exported from the telemetry thread once a second when given.
        ``runtime``: how the engine runs speculation, sent with every context."""
        self.config = config
        self.runtime = runtime
        self.metrics = metrics
        client_config = ClientConfig(
            target=config.sidecar,
            engine_id=config.engine_id,
            deadline_s=config.deadline_ms / 1000,
            decision_tables=config.decision_tables,
            fallback_schedule=config.fallback_table or fallback_table or DEFAULT_SCHEDULE,
            tls=config.tls,
        )
        self.client = client_factory(client_config)
        # The engine's thread owns these: the step index, the γ the last step ran, the
        # engine as last scheduled (what an idle engine's next step will resemble), and
        # when each step decided and not ended yet began (one with synchronous scheduling,
        # two with async).
        self._step_index = 0
        self._previous_gamma: int | None = None
        self._last_view: EngineView | None = None
        self._open_steps: collections.deque[float] = collections.deque()
        # Steps decided and ended, in order, for _settle (deque appends and pops are
        # thread-safe); _settle_lock serialises the settling threads.
        self._journal: collections.deque[_Decided | _Ended | str] = collections.deque()
        self._settle_lock = threading.Lock()
        # Settled state (under _settle_lock): decisions whose step has not ended / the
        # last ended one, awaiting its verify step.
        self._pending: collections.deque[_InFlight] = collections.deque()
        self._in_flight: _InFlight | None = None
        self._reported = 0
        # Verified in all steps, counted as vLLM's spec-decode metrics count them: drafted
        # and accepted tokens, requests that verified drafts (vLLM's "drafts").
        self._drafted = self._accepted = self._drafts = 0
        # Drafted tokens of the steps whose decision was reported.
        self._drafted_reported = 0
        self._gammas: collections.Counter[int] = collections.Counter()
        # Where each step's γ came from: sidecar, fallback, forced (draft not resident).
        self._sources: collections.Counter[str] = collections.Counter()
        self._hook_s = DurationHistogram()
        self._hook_cpu_s = DurationHistogram()
        self._step_s = DurationHistogram()
        # Per step (hook wall, hook CPU, step wall seconds), queued by the engine's thread
        # and counted into the histograms by whoever reads them (_count_samples): off the
        # hook. Hook times counted but not yet exported to the metrics (swapped out by
        # each flush).
        self._samples: collections.deque[tuple[float, float, float]] = collections.deque()
        self._hook_unexported: list[float] = []
        self._hook_decide = HookTime()
        # Per-request policies (DSDE): whether the sidecar's policy reads per-request
        # signals (as its last answer said), each request's accepted drafts in its last
        # verification, and the per-request γ of the step decided last.
        self._reads_request_signals = False
        self._last_accepts: dict[str, int] = {}
        self._request_gammas: tuple[tuple[str, int], ...] = ()
        self._truncated = collections.Counter[str]()
        self._lock = threading.Lock()
        self.client.gather_reports_with(self._settle)
        # The stats file and the metrics are written off the engine's thread: sorting the
        # samples for percentiles takes milliseconds, and both stay fresh while it idles.
        self._closed = threading.Event()
        self._writer: threading.Thread | None = None
        if config.stats_file or metrics is not None:
            self._writer = threading.Thread(
                target=self._telemetry_loop, name="nightjar-stats", daemon=True
            )
            self._writer.start()

    def _context(
        self,
        view: EngineView,
        step_index: int,
        previous_gamma: int | None,
        requests: tuple[RequestSignals, ...] = (),
        candidates: tuple[int, ...] = (),
    ) -> StepContext:
        """The step's context, from its arguments and the configuration only (the sender
        thread builds some: nothing the engine's thread changes is read here)."""
        return StepContext(
            engine_id=self.config.engine_id,
            learner_key=self.config.learner_key,
            batch_size=max(1, view.batch_size),
            step_index=step_index,
            num_waiting=view.waiting,
            free_kv_blocks=max(0, min(view.free_kv_blocks, view.total_kv_blocks)),
            total_kv_blocks=view.total_kv_blocks,
            # vLLM's drafter keeps its KV cache in step at γ = 0 (it runs its first pass
            # anyway), so re-enabling speculation has no catch-up to do.
            max_draft_lag_tokens=0,
            draft_resident=view.draft_resident,
            previous_gamma=previous_gamma,
            max_gamma=view.max_gamma,
            context_tokens=view.context_tokens,
            candidate_batch_sizes=candidates,
            min_draft_passes=min(view.min_draft_passes, view.max_gamma),
            runtime=self.runtime,
            requests=requests,
        )

    def _request_signals(self, view: EngineView) -> tuple[RequestSignals, ...]:
        """Each drafting request with the accepted drafts of its last verification (none
        for a request that has not verified yet). No divergence: vLLM keeps no draft
        distribution where the scheduler runs (docs/VLLM_PLUGIN.md, "Per-request γ")."""
        last = self._last_accepts
        return tuple(
            RequestSignals(request_id, recent_accepts=(last[request_id],))
            if request_id in last
            else RequestSignals(request_id)
            for request_id in view.request_ids
        )

    @property
    def wants_request_ids(self) -> bool:
        """Whether the sidecar's policy reads per-request signals: the scheduler then names
        the drafting requests in its views and verified steps."""
        return self._reads_request_signals

    def request_gammas(self) -> dict[str, int]:
        """γ per request of the step decided last, where a per-request policy set one
        below the step's γ (its drafts are cut to it); {} = all run the step's γ."""
        if not self._request_gammas or self._previous_gamma is None:
            return {}
        cap = self._previous_gamma
        return {request: gamma for request, gamma in self._request_gammas if gamma < cap}

    def truncated(self, requests: int, tokens: int) -> None:
        """The scheduler cut ``tokens`` drafts of ``requests`` requests to their γ."""
        self._truncated["requests"] += requests
        self._truncated["tokens"] += tokens

    def decide(self, view: EngineView, started: HookTime | None = None) -> int:
        """γ for the step being scheduled (drafted after it, verified in the next).

        ``started``: when the caller's hook began (:meth:`HookTime.now`), so that the hook
        time counts the caller's own work (default: now).
        """
        started = HookTime.now() if started is None else started
        batch_size = max(1, view.batch_size)
        taken = self.client.take_from_table(batch_size, self._previous_gamma == 0)
        if taken is None:  # no table, or not this step's: ask (or fall back)
            return self._decide_asking(view, started)
        # The usual step: the held table answers it; its context is built off this thread
        # unless a per-request policy needs this step's signals in it.
        table = taken.held.table
        step_index, previous = self._step_index, self._previous_gamma
        ctx = (
            self._context(view, step_index, previous, self._request_signals(view))
            if self._reads_request_signals
            else None
        )
        gamma = self._ran_gamma(taken.gamma, view)
        self._reads_request_signals = table.reads_request_signals
        self._request_gammas = table.request_gammas
        self._journal.append((view, step_index, previous, ctx, taken, gamma, started.wall))
        self._opened(view, gamma, started)
        requests = ctx.requests if ctx is not None else ()
        after = functools.partial(self._context, view, step_index + 1, gamma, requests)
        self.client.ask_ahead(LazyStep(batch_size, gamma == 0, after))
        self._hook_decide = started.elapsed()
        return gamma

    def _decide_asking(self, view: EngineView, started: HookTime) -> int:
        """A step the held table cannot answer (or without tables): asked of the sidecar,
        within the deadline, else the fallback table. The steps before it are settled
        first, so that their reports ride on its request: the sidecar commits the steps
        run from its last table before it decides the next (else that table's posterior
        draw would be drawn again). With tables the client's sender thread settles them
        (gather_reports_with) as it builds the request. Its own step is reported from the
        journal."""
        tables = self.client.uses_tables
        if not tables:
            self._settle()
        previous_batch = self._last_view.batch_size if self._last_view else view.batch_size
        step_index, previous = self._step_index, self._previous_gamma
        requests = self._request_signals(view) if self._reads_request_signals else ()
        ctx = self._context(view, step_index, previous, requests)
        decision = self.client.take(ctx, report_ran=False)
        gamma = self._ran_gamma(decision.gamma, view)
        reads = decision.reads_request_signals
        if reads is not None:  # a fallback says nothing of the sidecar's policy
            self._reads_request_signals = reads
        self._request_gammas = decision.request_gammas
        self._journal.append((view, step_index, previous, ctx, decision, gamma, started.wall))
        self._opened(view, gamma, started)
        # Ask for the next step now, for the batch as it is and as it may become. With
        # decision tables: a new table, when the held one is due or will not answer it
        # (that step's context is then built off this thread).
        if tables:
            self.client.prefetch_after(ctx, gamma)
        else:
            candidates = candidate_batch_sizes(
                max(1, view.batch_size), view.waiting, view.batch_size - previous_batch
            )
            self.client.prefetch(self._context(view, step_index + 1, gamma, requests, candidates))
        self._hook_decide = started.elapsed()
        return gamma

    @staticmethod
    def _ran_gamma(gamma: int, view: EngineView) -> int:
        """The γ the engine runs: no drafter runs while the draft is away, whatever the
        sidecar or the table said, and never above the engine's Γmax."""
        return max(0, min(gamma, view.max_gamma if view.draft_resident else 0))

    def _opened(self, view: EngineView, gamma: int, started: HookTime) -> None:
        """A step was decided (the engine's thread's own state)."""
        self._open_steps.append(started.wall)
        self._previous_gamma = gamma
        self._last_view = view

    def memory_directives(self) -> list[MemoryDirective]:
        """Memory directives the sidecar sent since the last call (for the memory agent)."""
        return self.client.take_directives()

    def end_step(self, verified: VerifiedStep, hook: HookTime | None = None) -> None:
        """Report the decision whose drafts this step verified.

        ``hook``: time the caller's hook already spent on this update (counting it).
        """
        started = time.perf_counter()
        begun_cpu = time.thread_time()
        if verified.request_ids:  # a per-request policy's signals for the next step
            self._last_accepts = dict(
                zip(verified.request_ids, verified.request_accepts, strict=True)
            )
        journal = self._journal
        journal.append((verified, started))
        if len(journal) >= 2 * REPORT_BATCH_OUTCOMES:
            self.client.flush_soon()  # the sender settles them and sends their reports
        if not self._open_steps:
            return  # nothing decided for this step (nothing sampled in it)
        step_started = self._open_steps.popleft()
        self._step_index += 1
        ended = time.perf_counter()
        ended_cpu = time.thread_time()
        decided, verified_in = self._hook_decide, hook or HookTime()
        self._samples.append(
            (
                decided.wall + verified_in.wall + ended - started,
                decided.cpu + verified_in.cpu + ended_cpu - begun_cpu,
                ended - step_started,
            )
        )
        if len(self._samples) >= MAX_QUEUED_SAMPLES:  # nobody reads them: bounded anyway
            self._count_samples()

    def _settle(self) -> None:
        """Settle the journal: the bookkeeping of the steps journaled so far, in order."""
        with self._settle_lock:
            journal = self._journal
            while journal:
                record = journal.popleft()
                if record is IDLE:
                    self._in_flight = None
                elif len(record) == 2:
                    self._settle_ended(*record)
                else:
                    self._settle_decided(*record)

    def _settle_decided(
        self,
        view: EngineView,
        step_index: int,
        previous: int | None,
        ctx: StepContext | None,
        taken: TableStep | GammaDecision,
        gamma: int,
        started: float,
    ) -> None:
        if isinstance(taken, TableStep):  # the held table's entry
            decision = GammaDecision(taken.gamma, "sidecar", table_step=taken)
        else:  # asked: a table's entry too, or a decision the client reported, or a fallback
            decision = taken
        if decision.table_step is not None:
            if ctx is None:
                ctx = self._context(view, step_index, previous)
            self.client.ran(decision.table_step, ctx)
        ran = decision if gamma == decision.gamma else dataclasses.replace(decision, gamma=gamma)
        self._pending.append(_InFlight(ran, started, view.prefill_tokens))
        self._gammas[gamma] += 1
        self._sources[decision.source if view.draft_resident else "forced"] += 1

    def _settle_ended(self, verified: VerifiedStep, started: float) -> None:
        self._drafted += verified.drafted_tokens
        self._accepted += verified.accepted_tokens
        self._drafts += len(verified.request_accepts)
        if not self._pending:
            # No decision this step (nothing sampled in it): whatever the in-flight
            # decision drafted was not verified here, and pairing it with a later
            # step would credit it with someone else's tokens.
            self._in_flight = None
            return
        step = self._pending.popleft()
        if self._in_flight is not None:
            # The time and the prefill are this step's: it verified the in-flight drafts,
            # and its drafter proposed this step's decision's (its γ's draft passes).
            self._report(self._in_flight, verified, started - step.started, step)
        self._in_flight = step

    def idle(self) -> None:
        """The engine ran out of requests: drop the unverifiable last decision, send the
        queued outcome now rather than with the next request (maybe much later), and ask
        ahead for the step that ends the idle time: one request joining, or a few together.
        Without it the first step after every idle gap waits a round trip (at low load,
        most of the prefetch misses). Only where the sidecar sends policy notices: the
        answer may be taken minutes later, and a policy swapped in meanwhile must decide
        that step (the client drops the answer on a notice)."""
        self._journal.append(IDLE)
        self._settle()
        self.client.discard_prefetch()  # asked for a batch that has finished
        self.client.flush()
        if self._last_view is None or not self.client.follows_policy_changes:
            return
        resumed = dataclasses.replace(
            self._last_view, batch_size=1, waiting=0, context_tokens=0, prefill_tokens=0
        )
        joins = tuple(range(2, 2 + CANDIDATE_JOINS))
        self.client.prefetch(
            self._context(resumed, self._step_index, self._previous_gamma, candidates=joins)
        )

    def _report(
        self, flight: _InFlight, verified: VerifiedStep, seconds: float, step: _InFlight
    ) -> None:
        decision_id = flight.decision.decision_id
        if not decision_id or seconds <= 0:
            return  # a fallback decision: the sidecar never saw it
        self.client.report(
            StepOutcome(
                decision_id=decision_id,
                engine_id=self.config.engine_id,
                gamma=flight.decision.gamma,
                step_seconds=seconds,
                generated_tokens=verified.generated_tokens,
                drafted_tokens=verified.drafted_tokens,
                accepted_tokens=verified.accepted_tokens,
                request_accepts=verified.request_accepts,
                prefill_tokens=step.prefill_tokens,
                draft_gamma=step.decision.gamma,
                request_ids=verified.request_ids if self._reads_request_signals else (),
            )
        )
        self._reported += 1
        self._drafted_reported += verified.drafted_tokens

    def stats(self) -> dict[str, Any]:
        self._settle()
        client = self.client.stats
        self._count_samples()
        return {
            "engine_id": self.config.engine_id,
            "steps": self._step_index,
            "reported": self._reported,
            "drafted_tokens": self._drafted,
            "accepted_tokens": self._accepted,
            "drafts": self._drafts,
            "drafted_tokens_reported": self._drafted_reported,
            "gammas": {str(g): n for g, n in sorted(self._gammas.items())},
            "sources": dict(self._sources),
            "sidecar_decisions": client.sidecar_decisions,
            "fallbacks": dict(client.fallbacks),
            "fallbacks_total": client.fallbacks_total,
            "prefetch_hits": client.prefetch_hits,
            "prefetch_misses": client.prefetch_misses,
            "prefetch_miss_reasons": dict(client.prefetch_miss_reasons),
            "late_replies": client.late_replies,
            "decision_tables": self.client.uses_tables,
            "tables": client.tables,
            "table_misses": dict(client.table_misses),
            "rejected_reports": client.rejected_reports,
            "request_signals": self._reads_request_signals,
            "truncated_drafts": dict(self._truncated),
            "connected": self.client.connected,
            "hook_us": _percentiles(self._hook_s, 1e6),
            "hook_cpu_us": _percentiles(self._hook_cpu_s, 1e6),
            "step_ms": _percentiles(self._step_s, 1e3),
        }

    def write_stats(self) -> None:
        """The counters as JSON, replaced atomically (operators and benchmarks read it)."""
        path = Path(self.config.stats_file)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.stats()))
            tmp.replace(path)
        except OSError as exc:
            log.warning("nightjar: cannot write stats to %s: %s", path, exc)

    def export_metrics(self) -> None:
        """Add what was counted since the last export to the Prometheus metrics."""
        if self.metrics is None:
            return
        self._settle()
        client = self.client.stats
        self._count_samples()
        with self._lock:
            hook, self._hook_unexported = self._hook_unexported, []
        self.metrics.flush(
            Totals(
                sources=dict(self._sources),
                fallbacks=dict(client.fallbacks),
                gammas=dict(self._gammas),
                prefetch_misses=client.prefetch_misses,
                new_hook_seconds=hook,
                truncated=dict(self._truncated),
            )
        )

    def _count_samples(self) -> None:
        """Count the queued per-step samples into the histograms (and, with metrics, the
        hook times to export)."""
        samples = self._samples
        with self._lock:
            while samples:
                hook, cpu, step = samples.popleft()
                self._hook_s.record(hook)
                self._hook_cpu_s.record(cpu)
                self._step_s.record(step)
                if self.metrics is not None:
                    self._hook_unexported.append(hook)

    def _telemetry_loop(self) -> None:
        while not self._closed.wait(STATS_INTERVAL_S):
            self._write_telemetry()

    def _write_telemetry(self) -> None:
        self.export_metrics()
        if self.config.stats_file:
            self.write_stats()

    def close(self) -> None:
        self._closed.set()
        if self._writer is not None:
            self._writer.join(timeout=5)
            self._write_telemetry()
        self.client.close()


def _percentiles(histogram: DurationHistogram, scale: float) -> dict[str, float]:
    return {
        "p50": histogram.quantile(0.5) * scale,
        "p99": histogram.quantile(0.99) * scale,
        "n": histogram.count,
    }
