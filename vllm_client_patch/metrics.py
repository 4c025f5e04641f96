"""The plugin's Prometheus metrics, served in vLLM's own ``/metrics``.

``vllm serve`` runs the scheduler, hence the plugin and the memory agent, in the
EngineCore process, and serves ``/metrics`` from the API-server process, out of
prometheus_client's default registry (``vllm/entrypoints/serve/instrumentator/metrics.py``,
``get_prometheus_registry`` in ``vllm/v1/metrics/prometheus.py``). vLLM carries its own
engine statistics to that process over its engine-core output queue, where a plugin has
no place; ours cross the way prometheus_client's multiprocess mode carries metrics: the
engine process keeps their values in mmap files in a directory, and a
``MultiProcessCollector`` on the API server's registry reads that directory at each scrape.

* :func:`install_collector` (from ``register()``, which vLLM runs in the API server before
  it starts the engine) makes the directory, names it in ``NIGHTJAR_METRICS_DIR`` for the
  processes vLLM starts afterwards, and adds the collector to the default registry. The
  directory is removed when that process exits.
* When vLLM itself runs in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set: several API
  servers, or the operator's choice) its registry already reads that directory: the
  plugin writes there and adds no collector.
* :func:`file_backed` builds metrics whose values live in those files, in whatever mode
  the rest of the engine process runs.

The engine's step loop never touches these metrics: it counts in plain integers (as it
did for the stats file), and the controller's telemetry thread adds what changed once a
second (:meth:`PluginMetrics.flush`), so the per-step cost is unchanged and a scrape is at
most a second behind.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from prometheus_client import REGISTRY, Counter, Histogram, values
from prometheus_client.multiprocess import MultiProcessCollector

from nightjar_common.buckets import GAMMA_BUCKETS

log = logging.getLogger(__name__)

METRICS_DIR_ENV = "NIGHTJAR_METRICS_DIR"
PROMETHEUS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Time in the hook per step: tens of µs (sidecar answer waiting) to the deadline and past.
HOOK_BUCKETS = (
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2e-3,
    3e-3,
    5e-3,
    1e-2,
    2.5e-2,
)
# The client's fallback reasons (client.py), exported from zero.
FALLBACK_REASONS = ("disconnected", "deadline", "rejected", "unavailable")
# Where a step's γ came from: the sidecar, the local table, or forced to 0 by the plugin
# (draft not resident).
SOURCES = ("sidecar", "fallback", "forced")

T = TypeVar("T")

_collector_lock = threading.Lock()
_construct_lock = threading.Lock()
_collector_dir: str | None = None
# prometheus_client's multiprocess value class, one per directory (each keeps its files).
_file_values: dict[str, Any] = {}


def metrics_dir() -> str | None:
    """Where this process's file-backed metrics go (None: nowhere, metrics off)."""
    return os.environ.get(PROMETHEUS_DIR_ENV) or os.environ.get(METRICS_DIR_ENV) or None


def install_collector() -> str | None:
    """Make this process's default registry serve the plugin's metrics files (idempotent).

    The first process to call it (vLLM's API server) creates the directory; the processes
    it starts inherit it through the environment. Returns the directory, or None when it
    cannot be made (the plugin then runs without metrics, said once in the log).
    """
    global _collector_dir
    if os.environ.get(PROMETHEUS_DIR_ENV):
        return os.environ[PROMETHEUS_DIR_ENV]  # vLLM's registry reads it already
    with _collector_lock:
        if _collector_dir is not None:
            return _collector_dir
        directory = os.environ.get(METRICS_DIR_ENV)
        try:
            if not directory:
                directory = tempfile.mkdtemp(prefix="nightjar-metrics-")
                atexit.register(_remove_dir, directory, os.getpid())
                os.environ[METRICS_DIR_ENV] = directory
            MultiProcessCollector(REGISTRY, path=directory)
        except (OSError, ValueError) as exc:
            log.warning("nightjar: plugin metrics off: cannot use a metrics directory: %s", exc)
            return None
        _collector_dir = directory
        return directory


def _remove_dir(directory: str, owner_pid: int) -> None:
    if os.getpid() == owner_pid:  # not in a forked child that inherited the handler
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def _values_in(directory: str) -> Iterator[None]:
    """Metrics constructed inside keep their values in prometheus_client's multiprocess
    files in ``directory`` — what PROMETHEUS_MULTIPROC_DIR at start-up does for a whole
    process, for these metrics only. Construct every labelled child inside too."""
    saved_class, saved_dir = values.ValueClass, os.environ.get(PROMETHEUS_DIR_ENV)
    os.environ[PROMETHEUS_DIR_ENV] = directory  # read when the value opens its file
    if directory not in _file_values:
        _file_values[directory] = values.MultiProcessValue()
    values.ValueClass = _file_values[directory]
    try:
        yield
    finally:
        values.ValueClass = saved_class
        if saved_dir is None:
            del os.environ[PROMETHEUS_DIR_ENV]
        else:
            os.environ[PROMETHEUS_DIR_ENV] = saved_dir


def file_backed(build: Callable[[], T]) -> T | None:
    """``build()`` with its metrics in the metrics directory; None when there is none."""
    directory = metrics_dir()
    if directory is None or not os.path.isdir(directory):
        return None
    try:
        with _construct_lock, _values_in(directory):
            return build()
    except (OSError, ValueError) as exc:
        log.warning("nightjar: metrics off: cannot write to %s: %s", directory, exc)
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class Totals:
    """The controller's cumulative counts at one moment (what a flush exports)."""

    sources: Mapping[str, int]
    fallbacks: Mapping[str, int]
    gammas: Mapping[int, int]
    # Steps the held decision table could not answer (ClientStats.table_misses).
    table_misses: int
    # Hook times of the steps since the previous flush, seconds.
    new_hook_seconds: Iterable[float] = ()
    # Drafts cut to their request's γ: "requests" and "tokens" (controller.truncated).
    truncated: Mapping[str, int] = dataclasses.field(default_factory=dict)


class PluginMetrics:
    """``nightjar_plugin_*``: where γ came from, why the sidecar was bypassed, the γ run,
    the hook's time per step. Build with :meth:`create` (file-backed) in the engine."""

    def __init__(self) -> None:
        # registry=None: the values are read from their files, never from a registry here.
        decisions = Counter(
            "nightjar_plugin_decisions",
            "Steps whose γ the plugin decided, by source (sidecar|fallback|forced: γ = 0 "
            "while the draft is not resident).",
            ["source"],
            registry=None,
        )
        fallbacks = Counter(
            "nightjar_plugin_fallbacks",
            "Decisions taken from the local fallback table, by reason.",
            ["reason"],
            registry=None,
        )
        self.hook_seconds = Histogram(
            "nightjar_plugin_hook_seconds",
            "Time inside the plugin's scheduler hooks per engine step.",
            buckets=HOOK_BUCKETS,
            registry=None,
        )
        self.gamma = Histogram(
            "nightjar_plugin_gamma",
            "γ the engine actually ran per step.",
            buckets=GAMMA_BUCKETS,
            registry=None,
        )
        self.table_misses = Counter(
            "nightjar_plugin_table_misses",
            "Steps the held decision table could not answer: asked the sidecar, waiting "
            "at most the deadline.",
            registry=None,
        )
        # Per-request γ (a policy that decides per request): what the scheduler cut.
        self.truncated = {
            "requests": Counter(
                "nightjar_plugin_truncated_requests",
                "Requests whose drafts were cut to their own γ below the step's (counted "
                "per step).",
                registry=None,
            ),
            "tokens": Counter(
                "nightjar_plugin_truncated_drafts",
                "Draft tokens cut to their request's γ before verification.",
                registry=None,
            ),
        }
        self.decisions = {source: decisions.labels(source) for source in SOURCES}
        self._fallbacks = fallbacks
        self.fallbacks = {reason: fallbacks.labels(reason) for reason in FALLBACK_REASONS}
        self._exported = Totals({}, {}, {}, 0)

    @classmethod
    def create(cls) -> PluginMetrics | None:
        return file_backed(cls)

    def flush(self, totals: Totals) -> None:
        """Export what changed since the previous flush (one thread calls this)."""
        before = self._exported
        for source, count in totals.sources.items():
            _add(self.decisions.get(source), count - before.sources.get(source, 0))
        for reason, count in totals.fallbacks.items():
            if reason not in self.fallbacks:  # a reason FALLBACK_REASONS does not list
                make = functools.partial(self._fallbacks.labels, reason)
                self.fallbacks[reason] = file_backed(make)
            _add(self.fallbacks[reason], count - before.fallbacks.get(reason, 0))
        for gamma, count in totals.gammas.items():
            for _ in range(count - before.gammas.get(gamma, 0)):
                self.gamma.observe(gamma)
        _add(self.table_misses, totals.table_misses - before.table_misses)
        for kind, count in totals.truncated.items():
            _add(self.truncated.get(kind), count - before.truncated.get(kind, 0))
        for seconds in totals.new_hook_seconds:
            self.hook_seconds.observe(seconds)
        self._exported = dataclasses.replace(totals, new_hook_seconds=())


def _add(counter: Any, delta: int) -> None:
    if counter is not None and delta > 0:
        counter.inc(delta)
