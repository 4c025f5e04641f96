"""The cyclic garbage collector's pauses: the started sidecar's heap frozen, each pause
measured.

A collection holds the GIL for as long as it scans, so while one runs no engine is
answered. A full collection scans every tracked object in the process, and a sidecar
holds tens of thousands once started (modules, gRPC, NumPy, the policy). CPython
before 3.14 starts one whenever a quarter as many objects again have reached the oldest
generation since the last, which a heavy request's thousands of short-lived objects (a
context with thousands of per-request sections, parsed on a heavy-step thread) do every
few requests. Frozen (``gc.freeze``: CPython's permanent generation), those objects are
never scanned again; what is made later is collected as usual.
``nightjar_gc_pause_seconds{generation}`` shows what collections still cost, and
``nightjar_gc_frozen_objects`` that the freeze happened (docs/OPERATIONS.md).
"""

from __future__ import annotations

import bisect
import gc
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

# Upper bounds of the pause histogram's buckets, seconds: around the plugin's 2 ms deadline.
PAUSE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
GENERATIONS = 3


class PauseRecorder:
    """Every collection's duration by generation, recorded from ``gc.callbacks``.

    No lock: the callbacks never run at once (one collection at a time, under the GIL,
    and none starts inside a callback), and a scrape reads counts that only grow. A lock
    here could deadlock: a collection may start in any thread, inside any lock's holder.
    """

    def __init__(self) -> None:
        self._started = 0.0
        # Per generation: a count per bucket (the last: above PAUSE_BUCKETS) and the sum.
        self.counts = [[0] * (len(PAUSE_BUCKETS) + 1) for _ in range(GENERATIONS)]
        self.sums = [0.0] * GENERATIONS

    def install(self) -> None:
        """Start recording (once: installing again changes nothing)."""
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        seconds = time.perf_counter() - self._started
        generation = info["generation"]
        self.counts[generation][bisect.bisect_left(PAUSE_BUCKETS, seconds)] += 1
        self.sums[generation] += seconds

    def collect(self) -> Iterator[GaugeMetricFamily | HistogramMetricFamily]:
        pauses = HistogramMetricFamily(
            "nightjar_gc_pause_seconds",
            "How long each of CPython's cyclic garbage collections held the GIL (no engine "
            "is answered meanwhile), by generation (2: a full collection).",
            labels=("generation",),
        )
        for generation in range(GENERATIONS):
            counts, cumulative, buckets = self.counts[generation], 0, []
            for bound, count in zip((*PAUSE_BUCKETS, float("inf")), counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            pauses.add_metric((str(generation),), buckets, self.sums[generation])
        yield pauses
        yield GaugeMetricFamily(
            "nightjar_gc_frozen_objects",
            "Objects the sidecar froze once started (and after a restore): never scanned by "
            "a collection again.",
            value=gc.get_freeze_count(),
        )


# One for the process: the collector is the process's.
RECORDER = PauseRecorder()


def freeze_started_heap() -> int:
    """Freeze what the process holds now (call once the sidecar has started); the count of
    frozen objects. Only a reference cycle among them would outlive its last reference:
    what start-up makes lives as long as the process."""
    gc.freeze()
    return gc.get_freeze_count()
