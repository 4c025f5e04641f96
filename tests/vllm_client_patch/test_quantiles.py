"""The plugin's constant-memory percentiles agree with exact ones within a bucket (1 %)."""

from __future__ import annotations

import random
import statistics

import pytest

from vllm_client_patch.quantiles import DurationHistogram


def test_quantiles_match_the_exact_ones_within_one_percent() -> None:
    rng = random.Random(3)
    # Hook-like: mostly hundreds of µs, a tail of milliseconds, a few stalls of 50 ms.
    samples = [rng.lognormvariate(-8.0, 0.4) for _ in range(20_000)]
    samples += [rng.uniform(1e-3, 5e-3) for _ in range(300)] + [0.05] * 20
    histogram = DurationHistogram()
    for seconds in samples:
        histogram.record(seconds)
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    assert histogram.count == len(samples)
    for q, exact in ((0.5, cuts[49]), (0.99, cuts[98])):
        assert histogram.quantile(q) == pytest.approx(exact, rel=0.015)
    assert histogram.quantile(1.0) == pytest.approx(0.05, rel=0.015)


def test_empty_and_out_of_range_durations() -> None:
    histogram = DurationHistogram()
    assert histogram.quantile(0.99) == 0.0 and histogram.count == 0
    for seconds in (0.0, -1.0, 1e9):  # clock oddities land in the end buckets
        histogram.record(seconds)
    assert histogram.count == 3 and histogram.quantile(0.0) < 1e-6
    assert histogram.quantile(1.0) > 1e3
