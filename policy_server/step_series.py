"""The Prometheus series every engine step touches, tallied per thread and summed at scrape.

A decided step and its outcome touch seven series (decisions, γ chosen, table steps,
reports, goodput, step duration, acceptance). prometheus_client's ``Counter.inc`` and
``Histogram.observe`` take a lock and walk the buckets in Python on every call: 12 % of the
instructions of a step through decision tables (`make bench-instructions`' walk with them
stubbed out, docs/POLICIES.md "Prices of the decision path"). Here each thread adds to its
own tally without a lock (one writer per tally, so no update is lost), and a scrape sums
the tallies. The exposition is what the prometheus_client metrics it replaces wrote:
names, help, labels, buckets, and the series that exist from the start.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString


# eq=False: a family is looked up by identity on every addition (a generated __hash__
# would hash all its fields in Python each time).
@dataclasses.dataclass(frozen=True, eq=False)
class CounterSeries:
    """A counter (exposed as ``<name>_total``) and the label values shown from the start."""

    name: str
    documentation: str
    labels: tuple[str, ...]
    preset: tuple[tuple[str, ...], ...] = ()


@dataclasses.dataclass(frozen=True, eq=False)
class HistogramSeries:
    """A histogram with upper bounds ``buckets`` (+Inf added) and its preset label values."""

    name: str
    documentation: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...]
    preset: tuple[tuple[str, ...], ...] = ((),)


@dataclasses.dataclass
class _Tally:
    """One thread's additions: per family, label values → a counter's value, or a
    histogram's per-bucket counts (the last for +Inf) followed by its sum."""

    counters: list[dict[tuple[str, ...], float]]
    histograms: list[dict[tuple[str, ...], list[float]]]


class StepSeries:
    """A collector for the step series (register it on a registry)."""

    def __init__(
        self, counters: Sequence[CounterSeries], histograms: Sequence[HistogramSeries]
    ) -> None:
        self._counters = {family: i for i, family in enumerate(counters)}
        self._histograms = {family: i for i, family in enumerate(histograms)}
        self._local = threading.local()
        self._tallies: list[_Tally] = []
        self._lock = threading.Lock()  # guards _tallies (a thread's first addition)

    def count(self, family: CounterSeries, labels: tuple[str, ...], amount: float = 1.0) -> None:
        series = self._tally().counters[self._counters[family]]
        series[labels] = series.get(labels, 0.0) + amount

    def observe(self, family: HistogramSeries, labels: tuple[str, ...], value: float) -> None:
        series = self._tally().histograms[self._histograms[family]]
        counts = series.get(labels)
        if counts is None:
            counts = series[labels] = [0.0] * (len(family.buckets) + 2)
        # The first bound not below the value (a value on a bound counts in its bucket).
        counts[bisect.bisect_left(family.buckets, value)] += 1.0
        counts[-1] += value

    def value(self, family: CounterSeries, labels: tuple[str, ...]) -> float:
        """A counter's value summed over the threads (0 for a series never added to)."""
        index = self._counters[family]
        return sum(tally.counters[index].get(labels, 0.0) for tally in self._snapshot())

    def total(self, family: CounterSeries) -> float:
        """A counter's value summed over every label set and thread."""
        index = self._counters[family]
        return sum(sum(tally.counters[index].copy().values()) for tally in self._snapshot())

    def describe(self) -> Iterator[Metric]:
        """The families without samples (what a registry checks names against)."""
        for family in self._counters:
            yield CounterMetricFamily(family.name, family.documentation, labels=family.labels)
        for histogram in self._histograms:
            yield HistogramMetricFamily(
                histogram.name, histogram.documentation, labels=histogram.labels
            )

    def collect(self) -> Iterator[Metric]:
        tallies = self._snapshot()
        for family, index in self._counters.items():
            totals = dict.fromkeys(family.preset, 0.0)
            for tally in tallies:
                for labels, value in tally.counters[index].copy().items():
                    totals[labels] = totals.get(labels, 0.0) + value
            counter = CounterMetricFamily(family.name, family.documentation, labels=family.labels)
            for labels, value in sorted(totals.items()):
                counter.add_metric(list(labels), value)
            yield counter
        for histogram, index in self._histograms.items():
            width = len(histogram.buckets) + 2
            sums = {labels: [0.0] * width for labels in histogram.preset}
            for tally in tallies:
                for labels, counts in tally.histograms[index].copy().items():
                    total = sums.setdefault(labels, [0.0] * width)
                    for i, count in enumerate(list(counts)):  # a copy: its thread may add
                        total[i] += count
            yield self._histogram_family(histogram, sums)

    def _histogram_family(
        self, histogram: HistogramSeries, sums: dict[tuple[str, ...], list[float]]
    ) -> HistogramMetricFamily:
        bounds = [*(floatToGoString(b) for b in histogram.buckets), "+Inf"]
        family = HistogramMetricFamily(
            histogram.name, histogram.documentation, labels=histogram.labels
        )
        for labels, counts in sorted(sums.items()):
            cumulative, buckets = 0.0, []
            for bound, count in zip(bounds, counts[:-1], strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric(list(labels), buckets, counts[-1])
        return family

    def _tally(self) -> _Tally:
        try:
            tally: _Tally = self._local.tally
        except AttributeError:
            tally = self._local.tally = _Tally(
                [{} for _ in self._counters], [{} for _ in self._histograms]
            )
            with self._lock:
                self._tallies.append(tally)
        return tally

    def _snapshot(self) -> list[_Tally]:
        with self._lock:
            return list(self._tallies)
