"""Prometheus metrics of the sidecar (names `nightjar_*`, units in names).

Each server owns its own CollectorRegistry so several can live in one process
(tests, benchmarks); it carries the process collectors (`process_*`, `python_*`) too.
Labels stay low-cardinality: no request or decision ids. The served exposition has no
`*_created` series (they double the series count and no rule or panel reads them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily

from nightjar_common.buckets import GAMMA_BUCKETS
from policy_server import gc_pauses, loop_lag
from policy_server.step_series import CounterSeries, HistogramSeries, StepSeries

# A loop stall: around the plugin's 2 ms deadline up to seconds (a stopped process).
LOOP_LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0, 2.5)
# Decision latency spans µs (in-process) to ms (slow host).
LATENCY_BUCKETS = (
    5e-6,
    1e-5,
    2e-5,
    5e-5,
    1e-4,
    2e-4,
    5e-4,
    1e-3,
    2e-3,
    5e-3,
    1e-2,
)
GOODPUT_BUCKETS = tuple(float(2**k) for k in range(0, 21))  # 1 .. ~1M tokens/s
STEP_BUCKETS = (1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
RATIO_BUCKETS = tuple(i / 10 for i in range(11))
# Batch sizes in power-of-two ranges: "1", "2-3", "4-7", ..., "128-255", "256+".
BATCH_BUCKETS = ("1", *(f"{2**k}-{2 ** (k + 1) - 1}" for k in range(1, 8)), "256+")


DECISIONS = CounterSeries(
    "nightjar_decisions",
    "Decisions served, by policy, γ and bin type.",
    ("policy", "gamma", "bin_type"),
)
REPORTS = CounterSeries(
    "nightjar_reports", "Step outcomes received; result=applied|stale.", ("policy", "result")
)
TABLE_STEPS = CounterSeries(
    "nightjar_table_steps",
    "Steps engines ran from decision tables (StepRequest.ran_steps), by what the "
    "sidecar did with them: committed (learned from like a decision), late (learned "
    "from; newer tables were decided before it came), stale (the table's policy is "
    "no longer active), unknown (a table it does not know, or a batch size outside it), "
    "replayed (reported before: learned once), refused (a γ above what its table entry, "
    "the step's max_gamma, the draft's residence or Γmax allowed).",
    ("result",),
    preset=(("committed",), ("late",), ("stale",), ("unknown",), ("replayed",), ("refused",)),
)
GOODPUT = HistogramSeries(
    "nightjar_goodput_tokens_per_second",
    "Realized goodput of reported steps.",
    ("gamma",),
    GOODPUT_BUCKETS,
    preset=(),
)
ACCEPTANCE = HistogramSeries(
    "nightjar_acceptance_ratio",
    "Accepted / drafted tokens of reported steps, by γ.",
    ("gamma",),
    RATIO_BUCKETS,
    preset=(),
)
GAMMA_CHOSEN = HistogramSeries(
    "nightjar_gamma_chosen",
    "γ decided, by the step's batch size (power-of-two ranges); "
    "rate(_sum) / rate(_count) is the average γ.",
    ("batch_bucket",),
    GAMMA_BUCKETS,
    preset=tuple((bucket,) for bucket in BATCH_BUCKETS),
)
STEP_DURATION = HistogramSeries(
    "nightjar_step_duration_seconds", "Engine step wall time as reported.", (), STEP_BUCKETS
)


class RequestModes:
    """``nightjar_request_mode{engine, mode, reason}`` = 1 for each engine of the active
    policy that says its engines' per-request modes (goodput's ``request_modes``: engine
    id → (mode, reason)), read from the policy at scrape time; none for other policies."""

    def __init__(self) -> None:
        self._policy: Callable[[], object] = lambda: None

    def watch(self, policy: Callable[[], object]) -> None:
        """Read the modes from what ``policy()`` returns (the active policy) at each scrape."""
        self._policy = policy

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "nightjar_request_mode",
            "1 per engine for the mode its policy decides γ in: mode=per-request (a γ per "
            "request) or batch, reason=why (forced_on, forced_off, engine_cannot_apply, "
            "tpot_slo, learning, gain_above_margin, gain_below_margin).",
            labels=("engine", "mode", "reason"),
        )
        modes = getattr(self._policy(), "request_modes", None)
        shown: Mapping[str, tuple[str, str]] = modes() if callable(modes) else {}
        for engine_id, (mode, reason) in sorted(shown.items()):
            family.add_metric((engine_id, mode, reason), 1.0)
        yield family


# nightjar_bytes_held{structure} and nightjar_byte_budget_refusals_total{structure}.
BYTE_STRUCTURES = (
    "pending",
    "tables",
    "stream_queues",
    "plan_cache",
    "request_records",
    "decision_log",
)
# Those whose refusals nightjar_byte_budget_refusals_total counts (the decision log's
# are its drops, nightjar_decision_log_dropped_total).
REFUSING_STRUCTURES = ("pending", "stream_queues")


def batch_bucket(batch_size: int) -> int:
    """Index into BATCH_BUCKETS of a batch size (≥ 1)."""
    return min(max(batch_size, 1).bit_length() - 1, len(BATCH_BUCKETS) - 1)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # Labelled children of the step metrics, by (metric, labels): see child().
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        # The series every step touches (policy_server/step_series.py).
        self.steps = StepSeries(
            (DECISIONS, REPORTS, TABLE_STEPS), (GOODPUT, ACCEPTANCE, GAMMA_CHOSEN, STEP_DURATION)
        )
        r.register(self.steps)
        self.decision_latency = Histogram(
            "nightjar_decision_latency_seconds",
            "Time to compute a decision inside the server.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.loop_lag = Histogram(
            "nightjar_event_loop_lag_seconds",
            f"How late the decision loop ran a timer due every {1000 * loop_lag.PERIOD_S:g} "
            "ms: while the loop is held, no engine is answered (policy_server/loop_lag.py).",
            buckets=LOOP_LAG_BUCKETS,
            registry=r,
        )
        self.invalid_requests = Counter(
            "nightjar_invalid_requests",
            "Rejected requests, by method and gRPC status code.",
            ["method", "code"],
            registry=r,
        )
        self.policy_swaps = Counter(
            "nightjar_policy_swaps",
            "Policy activations (swap, set-params, restore, reset).",
            ["result"],
            registry=r,
        )
        self.snapshots = Counter(
            "nightjar_snapshots",
            "State snapshots written; result=ok|failed.",
            ["result"],
            registry=r,
        )
        self.snapshot_last_success = Gauge(
            "nightjar_snapshot_last_success_timestamp_seconds",
            "Unix time of the last snapshot this process wrote (0 = none yet).",
            registry=r,
        )
        self.expired_decisions = Counter(
            "nightjar_decisions_expired",
            "Decisions dropped from the pending table without an outcome.",
            registry=r,
        )
        self.engines = Gauge(
            "nightjar_engines",
            "Engines that asked for a decision recently (see DecisionService.engine_idle_s).",
            registry=r,
        )
        self.serving = Gauge(
            "nightjar_serving",
            "1 while a policy is loaded and gRPC health is SERVING, else 0.",
            registry=r,
        )
        self.decision_log_dropped = Counter(
            "nightjar_decision_log_dropped",
            "Decision-log records dropped (writer behind, write failed or unencodable).",
            registry=r,
        )
        self.memory_directives = Counter(
            "nightjar_memory_directives",
            "Memory directives issued, by engine and action.",
            ["engine", "action"],
            registry=r,
        )
        self.memory_draft_state = Gauge(
            "nightjar_memory_draft_state",
            "1 for the draft model's current state per engine "
            "(resident|offloading|offloaded|reloading).",
            ["engine", "state"],
            registry=r,
        )
        self.policy_info = Info("nightjar_policy", "The active policy.", registry=r)
        # Read from the active policy at scrape time (the server calls watch()).
        self.request_modes = RequestModes()
        r.register(self.request_modes)
        self.evictions = Counter(
            "nightjar_evictions",
            "Entries evicted to keep memory bounded (least recently used first), by kind: "
            "engine, learner_key, pending (a decision never reported).",
            ["kind"],
            registry=r,
        )
        self.superseded = Counter(
            "nightjar_superseded_contexts",
            "Step contexts not decided because a newer context of the same engine came "
            "on the same stream first (the engine had stopped waiting: it was overloaded "
            "or behind); answered ABORTED, their outcome applied.",
            registry=r,
        )
        self.tables = Counter(
            "nightjar_tables",
            "Decision tables issued (one per StepRequest with a context): each holds "
            "the γ of a range of batch sizes, for the steps an engine runs until the next.",
            registry=r,
        )
        self.skipped_outcomes = Counter(
            "nightjar_skipped_outcomes",
            "Batched outcomes (StepRequest.outcomes) naming a decision the sidecar does not "
            "hold (expired, or issued before a restart) or implausible for it (more drafts "
            "than its γ and batch allow, ...): counted and skipped.",
            registry=r,
        )
        self.policy_defects = Counter(
            "nightjar_policy_defects",
            "Policy answers the sidecar had to correct, by policy and kind: gamma_clamped "
            "(a γ outside 0..min(the engine's max_gamma, the policy's Γmax), or a request's "
            "γ above its step's, clamped before it reached the engine).",
            ["policy", "kind"],
            registry=r,
        )
        self.streams_open = Gauge(
            "nightjar_streams_open",
            "Engines' StepStreams open now (at most max_streams).",
            registry=r,
        )
        self.streams_refused = Counter(
            "nightjar_streams_refused",
            "StepStreams refused with RESOURCE_EXHAUSTED: max_streams were open.",
            registry=r,
        )
        self.streams_idle_closed = Counter(
            "nightjar_streams_idle_closed",
            "StepStreams closed (UNAVAILABLE) after sending nothing for "
            "stream_idle_timeout_s; the plugin opens a new one.",
            registry=r,
        )
        self.bytes_held = Gauge(
            "nightjar_bytes_held",
            'Estimated bytes held for clients, by structure (docs/OPERATIONS.md, "Bounded '
            'memory"): pending (decisions awaiting their outcome, their contexts), tables '
            "(decision tables issued, kept until their steps are reported), stream_queues "
            "(requests read ahead of their answers), plan_cache (per-request plan searches "
            "cached), request_records (per-request acceptance records), decision_log "
            "(records queued for the decision log's writer). Each has a byte "
            "budget; estimated from counts and lengths, not measured.",
            ["structure"],
            registry=r,
        )
        self.budget_refusals = Counter(
            "nightjar_byte_budget_refusals",
            "What was refused or not kept because its structure's byte budget was full, by "
            "structure (pending: a ran step not learned from; stream_queues: a stream's "
            "read-ahead paused).",
            ["structure"],
            registry=r,
        )
        for structure in BYTE_STRUCTURES:
            self.bytes_held.labels(structure)
        for structure in REFUSING_STRUCTURES:
            self.budget_refusals.labels(structure)
        for kind in ("engine", "learner_key", "pending"):
            self.evictions.labels(kind)
        # Zero series from the start, so that increase() sees the first failure.
        for result in ("ok", "failed"):
            self.policy_swaps.labels(result)
            self.snapshots.labels(result)
        # The usual rejections on the engines' streams, for the same reason.
        for method in ("StepStream",):
            for code in ("INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION"):
                self.invalid_requests.labels(method, code)
        # What the default registry would carry: process_*, python_info, python_gc_*.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        # nightjar_gc_pause_seconds, nightjar_gc_frozen_objects (gc_pauses.py).
        gc_pauses.RECORDER.install()
        r.register(gc_pauses.RECORDER)

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, kept: ``labels()`` validates its arguments and takes
        a lock on each call. Not for per-engine series (those are removed)."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def watch_bytes(self, structure: str, held: Callable[[], float]) -> None:
        """nightjar_bytes_held{structure} read from ``held()`` at each scrape."""
        self.bytes_held.labels(structure).set_function(held)

    def count_evictions(self, kind: str, count: int) -> None:
        self.evictions.labels(kind).inc(count)

    def forget_engine(self, engine_id: str) -> None:
        """Drop an evicted engine's per-engine series (memory directives, draft state)."""
        for metric in (self.memory_directives, self.memory_draft_state):
            for labels in [k for k in metric._metrics if k[0] == engine_id]:
                metric.remove(*labels)

    def snapshot_written(self, unix_time: float) -> None:
        self.snapshot_last_success.set(unix_time)
        self.snapshots.labels("ok").inc()

    def set_active_policy(self, name: str, version: str) -> None:
        self.policy_info.info({"name": name, "version": version})

    def serve_http(self, port: int, addr: str = "127.0.0.1") -> tuple[int, Callable[[], None]]:
        """Expose /metrics over HTTP; returns the bound port (``port`` 0 = any free one)
        and a function that stops the server."""
        disable_created_metrics()  # process-wide in prometheus_client: the server's process
        server, thread = start_http_server(port, addr=addr, registry=self.registry)

        def stop() -> None:
            server.shutdown()
            server.server_close()
            thread.join(timeout=2)

        return int(server.server_port), stop
