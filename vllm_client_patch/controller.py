"""The engine-side control loop, free of vLLM types: step views in, γ and outcomes out.

γ is decided once the step's batch is known (at the end of vLLM's schedule call), from
the table of γ per batch size the sidecar sent last (nightjar_common/client.py); right
after, the client asks for a new table if the held one is due, so the round trip
overlaps the forward pass and the next step normally finds its answer held. A step the
table cannot answer asks the sidecar and waits at most the client's deadline, then falls
back to the local table.

The engine's thread does as little as a step needs: a step the held table answers is
looked up and journaled (one tuple), a finished step journaled; the bookkeeping —
contexts (a per-request policy's request signals too), the steps run and their outcomes
for the sidecar, pairing each decision with the step that verified it, counters — is
settled from the journal (step_journal.py) by whichever thread next needs it. After a
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
    NightjarClient,
)
from nightjar_common.fallback import DEFAULT_SCHEDULE
from nightjar_common.tables import LazyStep, NextStep
from nightjar_common.types import EngineRuntime, MemoryDirective
from vllm_client_patch.config import PluginConfig
from vllm_client_patch.metrics import PluginMetrics, Totals
from vllm_client_patch.quantiles import DurationHistogram
from vllm_client_patch.step_journal import (
    NOTHING_VERIFIED,
    EngineView,
    StepContexts,
    StepJournal,
    VerifiedStep,
)

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 1.0
# Per-step samples queued for the histograms: counted on the engine's thread only when
# no telemetry thread has counted them for this many steps (none runs: no stats file, no
# metrics).
MAX_QUEUED_SAMPLES = 8192
# The hook's CPU time is also kept per batch size (the per-request walks grow with it),
# in these ranges: (first, last or None, label).
HOOK_BATCH_RANGES = ((1, 8, "1-8"), (9, 32, "9-32"), (33, None, "33+"))


def _batch_range(batch_size: int) -> str:
    """The HOOK_BATCH_RANGES label of ``batch_size``."""
    for first, last, label in HOOK_BATCH_RANGES:
        if batch_size >= first and (last is None or batch_size <= last):
            return label
    return HOOK_BATCH_RANGES[0][2]


class HookTime(NamedTuple):
    """Wall and engine-thread CPU seconds: a point in time (:meth:`now`) or a span
    (:meth:`elapsed`). Where the wall time of the hook far exceeds its CPU time, the thread
    was waiting, not working: for the GIL (the engine process's other Python threads) or
    for a core. A tuple: taken several times a step on the engine's thread."""

    wall: float = 0.0
    cpu: float = 0.0

    @classmethod
    def now(cls) -> HookTime:
        # The tuple built directly: a NamedTuple's own constructor is a Python call more.
        return _new_tuple(cls, (time.perf_counter(), time.thread_time()))

    def elapsed(self) -> HookTime:
        """The span from this point to now."""
        wall, cpu = self
        return _new_tuple(HookTime, (time.perf_counter() - wall, time.thread_time() - cpu))


_new_tuple = tuple.__new__


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
        # Each step's context, built from the engine's constants (any thread builds them).
        self.contexts = StepContexts(config.engine_id, config.learner_key, runtime)
        # What each step was, settled into reports and counters off the engine's thread.
        self.journal = StepJournal(self.client, self.contexts)
        self._hook_s = DurationHistogram()
        self._hook_cpu_s = DurationHistogram()
        self._step_s = DurationHistogram()
        # The hook's CPU split two ways, to tell where its tail comes from: by how the
        # step was decided (the held table, or asked of the sidecar / the fallback) and by
        # the batch size decided for.
        self._hook_cpu_by_path = {path: DurationHistogram() for path in ("table", "asked")}
        self._hook_cpu_by_batch = {r[2]: DurationHistogram() for r in HOOK_BATCH_RANGES}
        # Per step (hook wall, hook CPU, step wall seconds, decided by asking, batch size),
        # queued by the engine's thread and counted into the histograms by whoever reads
        # them (_count_samples): off the hook. Hook times counted but not yet exported to
        # the metrics (swapped out by each flush).
        self._samples: collections.deque[tuple[float, float, float, bool, int]] = (
            collections.deque()
        )
        self._hook_unexported: list[float] = []
        # The decide hook's wall and CPU seconds of the step decided last, whether it was
        # asked (not answered by the held table), and its batch size.
        self._decide_wall = self._decide_cpu = 0.0
        self._decide_asked = False
        self._decide_batch = 1
        # Per-request policies (DSDE): whether the sidecar's policy reads per-request
        # signals (as its last answer said), the last step that verified named requests'
        # drafts (their signals are built from it off the engine's thread), and the
        # per-request γ of the step decided last.
        self._reads_request_signals = False
        self._last_verified = NOTHING_VERIFIED
        self._request_gammas: tuple[tuple[str, int], ...] = ()
        self._truncated = collections.Counter[str]()
        self._lock = threading.Lock()
        self.client.defer_reports_to(self.journal)
        # Bound once: the engine's thread calls these every step.
        self._take = self.client.take_from_table
        self._ask_ahead = self.client.ask_ahead
        self._record = self.journal.record
        self._unsettled = self.journal.unsettled
        self._build_named = self.contexts.build_named
        # The stats file and the metrics are written off the engine's thread: sorting the
        # samples for percentiles takes milliseconds, and both stay fresh while it idles.
        self._closed = threading.Event()
        self._writer: threading.Thread | None = None
        if config.stats_file or metrics is not None:
            self._writer = threading.Thread(
                target=self._telemetry_loop, name="nightjar-stats", daemon=True
            )
            self._writer.start()

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
        batch_size = view.batch_size if view.batch_size > 1 else 1
        previous = self._previous_gamma
        taken = self._take(batch_size, previous == 0)
        if taken is None:  # no table, or not this step's: ask (or fall back)
            return self._decide_asking(view, batch_size, started)
        # The usual step: the held table answers it. Its context, and the next step's a
        # refresh would carry, are built off this thread from the view and what the
        # requests' signals come from (the step verified last, for a per-request policy).
        table = taken.held.table
        step_index = self._step_index
        named = self._last_verified if self._reads_request_signals else None
        gamma = self._ran_gamma(taken.gamma, view)
        self._reads_request_signals = table.reads_request_signals
        self._request_gammas = table.request_gammas
        wall, cpu = started
        self._record((view, step_index, previous, named, taken, gamma, wall))
        self._open_steps.append(wall)
        self._previous_gamma = gamma
        self._last_view = view
        after = functools.partial(self._build_named, view, step_index + 1, gamma, named)
        self._ask_ahead(LazyStep(batch_size, gamma == 0, after))
        self._decide_asked, self._decide_batch = False, batch_size
        self._decide_wall = time.perf_counter() - wall
        self._decide_cpu = time.thread_time() - cpu
        return gamma

    def _decide_asking(self, view: EngineView, batch_size: int, started: HookTime) -> int:
        """A step the held table cannot answer: asked of the sidecar, within the deadline,
        else the fallback table. The client's sender thread builds the step's context and
        settles the steps before it (the controller is its ReportSource) as it builds the
        request, so that their reports ride on it: the sidecar commits the steps run from
        its last table before it decides the next (else that table's posterior draw would
        be drawn again). This thread only hands it the step and waits, as for a step the
        table answers it builds no context; its own step is reported from the journal."""
        step_index, previous = self._step_index, self._previous_gamma
        named = self._last_verified if self._reads_request_signals else None
        build = self._build_named
        own = functools.partial(build, view, step_index, previous, named)
        decision = self.client.take_step(LazyStep(batch_size, previous == 0, own))
        gamma = self._ran_gamma(decision.gamma, view)
        reads = decision.reads_request_signals
        if reads is not None:  # a fallback says nothing of the sidecar's policy
            self._reads_request_signals = reads
        self._request_gammas = decision.request_gammas
        self._record((view, step_index, previous, named, decision, gamma, started.wall))
        self._opened(view, gamma, started)
        # A new table for the next step, when the held one is due or will not answer it
        # (that step's context is then built off this thread).
        after = functools.partial(build, view, step_index + 1, gamma, named)
        self.client.ask_ahead(LazyStep(batch_size, gamma == 0, after))
        self._decide_asked, self._decide_batch = True, batch_size
        decided = started.elapsed()
        self._decide_wall, self._decide_cpu = decided.wall, decided.cpu
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
            if len(verified.request_ids) != len(verified.request_accepts):
                raise ValueError("a verified step names as many requests as it has accepts")
            self._last_verified = verified
        self._record((verified, started))
        if self._unsettled() >= 2 * REPORT_BATCH_OUTCOMES:
            self.client.flush_soon()  # the sender settles them and sends their reports
        open_steps = self._open_steps
        if not open_steps:
            return  # nothing decided for this step (nothing sampled in it)
        step_started = open_steps.popleft()
        self._step_index += 1
        ended = time.perf_counter()
        ended_cpu = time.thread_time()
        hook_wall, hook_cpu = (0.0, 0.0) if hook is None else hook
        self._samples.append(
            (
                self._decide_wall + hook_wall + ended - started,
                self._decide_cpu + hook_cpu + ended_cpu - begun_cpu,
                ended - step_started,
                self._decide_asked,
                self._decide_batch,
            )
        )
        if len(self._samples) >= MAX_QUEUED_SAMPLES:  # nobody reads them: bounded anyway
            self._count_samples()

    def settle(self) -> None:
        """Settle the journal (the counters read it; the client's sender settles it
        before each report batch)."""
        self.journal.settle()

    def idle(self) -> None:
        """The engine ran out of requests: drop the unverifiable last decision, send the
        queued reports now rather than with the next request (maybe much later), and ask
        for a table for the step that ends the idle time (one request joining): without it
        the first step after every idle gap waits a round trip. A policy swapped in
        meanwhile decides that step: the client drops a table of the old policy on the
        sidecar's notice and asks again."""
        self.journal.idle()
        self.settle()
        self.client.flush()
        if self._last_view is None:
            return
        resumed = dataclasses.replace(
            self._last_view, batch_size=1, waiting=0, context_tokens=0, prefill_tokens=0
        )
        ctx = self.contexts.build(resumed, self._step_index, self._previous_gamma)
        self.client.ask_ahead(NextStep(ctx), always=True)

    def stats(self) -> dict[str, Any]:
        journal = self.journal
        journal.settle()
        client = self.client.stats
        self._count_samples()
        return {
            "engine_id": self.config.engine_id,
            "steps": self._step_index,
            "reported": journal.reported,
            "drafted_tokens": journal.drafted,
            "accepted_tokens": journal.accepted,
            "drafts": journal.drafts,
            "drafted_tokens_reported": journal.drafted_reported,
            "gammas": {str(g): n for g, n in sorted(journal.gammas.items())},
            "sources": dict(journal.sources),
            "sidecar_decisions": client.sidecar_decisions,
            "fallbacks": dict(client.fallbacks),
            "fallbacks_total": client.fallbacks_total,
            "late_replies": client.late_replies,
            "slow_replies": client.slow_replies,
            "longest_reply_ms": 1000 * client.longest_reply_s,
            "tables": client.tables,
            "table_misses": dict(client.table_misses),
            "rejected_reports": client.rejected_reports,
            "request_signals": self._reads_request_signals,
            "truncated_drafts": dict(self._truncated),
            "connected": self.client.connected,
            "hook_us": _percentiles(self._hook_s, 1e6),
            "hook_cpu_us": _percentiles(self._hook_cpu_s, 1e6),
            "hook_cpu_us_by_path": {
                path: _percentiles(h, 1e6) for path, h in self._hook_cpu_by_path.items()
            },
            "hook_cpu_us_by_batch": {
                label: _percentiles(h, 1e6) for label, h in self._hook_cpu_by_batch.items()
            },
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
        self.settle()
        client = self.client.stats
        self._count_samples()
        with self._lock:
            hook, self._hook_unexported = self._hook_unexported, []
        self.metrics.flush(
            Totals(
                sources=dict(self.journal.sources),
                fallbacks=dict(client.fallbacks),
                gammas=dict(self.journal.gammas),
                table_misses=sum(client.table_misses.values()),
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
                hook, cpu, step, asked, batch_size = samples.popleft()
                self._hook_s.record(hook)
                self._hook_cpu_s.record(cpu)
                self._hook_cpu_by_path["asked" if asked else "table"].record(cpu)
                self._hook_cpu_by_batch[_batch_range(batch_size)].record(cpu)
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
