"""Percentiles of a stream of durations in constant memory and time.

The plugin reports p50/p99 of its hook time and of the engine's step over every step of
a run. Keeping the samples and sorting them (100,000 of them, every second) held the GIL
for tens of milliseconds in the engine's own process, so the telemetry thread stalled the
very hook it measures. A log-bucketed histogram (HdrHistogram's idea, as Prometheus
native histograms) records in O(1) and answers within its bucket resolution (1 %).
"""

from __future__ import annotations

import math
import threading

# Bucket k holds durations in [LOWEST_S · RATIO^k, LOWEST_S · RATIO^(k+1)).
LOWEST_S = 1e-7
RATIO = 1.02
BUCKETS = math.ceil(math.log(1e4 / LOWEST_S) / math.log(RATIO))  # up to ~3 hours
_LOG_RATIO = math.log(RATIO)


class DurationHistogram:
    """Counts of durations (seconds) in log-spaced buckets; thread-safe."""

    def __init__(self) -> None:
        self._counts = [0] * BUCKETS
        self._total = 0
        self._lock = threading.Lock()

    def record(self, seconds: float) -> None:
        index = 0 if seconds <= LOWEST_S else int(math.log(seconds / LOWEST_S) / _LOG_RATIO)
        index = min(index, BUCKETS - 1)
        with self._lock:
            self._counts[index] += 1
            self._total += 1

    @property
    def count(self) -> int:
        return self._total

    def quantile(self, q: float) -> float:
        """The q-quantile (0 ≤ q ≤ 1) in seconds: the geometric middle of the bucket that
        holds it (within 1 %); 0.0 before anything was recorded."""
        with self._lock:
            counts, total = list(self._counts), self._total
        if total == 0:
            return 0.0
        rank = max(1, math.ceil(q * total))
        seen = 0
        for index, n in enumerate(counts):
            seen += n
            if seen >= rank:
                return LOWEST_S * math.pow(RATIO, index + 0.5)
        return LOWEST_S * math.pow(RATIO, BUCKETS - 0.5)
