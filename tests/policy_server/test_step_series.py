"""The step series expose what prometheus_client's Counter and Histogram would, and lose
nothing when many threads add at once."""

from __future__ import annotations

import random
import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from policy_server.metrics import Metrics
from policy_server.step_series import CounterSeries, HistogramSeries, StepSeries

RESULTS = CounterSeries("t_results", "Results.", ("policy", "result"), preset=(("p", "ok"),))
LATENCY = HistogramSeries("t_latency_seconds", "Latency.", ("gamma",), (0.5, 1.0, 2.0), preset=())
PLAIN = HistogramSeries("t_plain", "Unlabelled.", (), (1.0, 10.0))


def exposition(registry: CollectorRegistry) -> list[str]:
    """The lines, in order, without ``*_created`` (the served exposition has none:
    Metrics.serve_http turns them off process-wide)."""
    lines = generate_latest(registry).decode().splitlines()
    return sorted(line for line in lines if "_created" not in line)


def test_the_exposition_is_prometheus_clients_for_the_same_additions() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    series = StepSeries((RESULTS,), (LATENCY, PLAIN))
    ours.register(series)
    counter = Counter("t_results", "Results.", ["policy", "result"], registry=theirs)
    counter.labels("p", "ok")  # the preset series, there from the start
    latency = Histogram(
        "t_latency_seconds", "Latency.", ["gamma"], buckets=(0.5, 1.0, 2.0), registry=theirs
    )
    plain = Histogram("t_plain", "Unlabelled.", buckets=(1.0, 10.0), registry=theirs)
    assert exposition(ours) == exposition(theirs)  # before anything was added
    rng = random.Random(1)
    for _ in range(500):
        result = rng.choice(("ok", "stale", "late"))
        series.count(RESULTS, ("p", result))
        counter.labels("p", result).inc()
        # Values on the bounds too: a bound is its bucket's upper end, inclusive.
        value = rng.choice((0.5, 1.0, 2.0, 3.0, rng.uniform(0.0, 2.5)))
        gamma = str(rng.randrange(3))
        series.observe(LATENCY, (gamma,), value)
        latency.labels(gamma).observe(value)
        series.observe(PLAIN, (), value * 5)
        plain.observe(value * 5)
    assert exposition(ours) == exposition(theirs)
    assert series.value(RESULTS, ("p", "ok")) == counter.labels("p", "ok")._value.get()


def test_threads_adding_at_once_lose_nothing() -> None:
    series = StepSeries((RESULTS,), (PLAIN,))
    barrier = threading.Barrier(8)

    def add() -> None:
        barrier.wait()
        for i in range(5_000):
            series.count(RESULTS, ("p", "ok"))
            series.observe(PLAIN, (), float(i % 20))

    threads = [threading.Thread(target=add) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert series.value(RESULTS, ("p", "ok")) == 40_000
    registry = CollectorRegistry()
    registry.register(series)
    assert registry.get_sample_value("t_plain_count") == 40_000
    assert registry.get_sample_value("t_plain_bucket", {"le": "1.0"}) == 8 * 2 * 250
    assert registry.get_sample_value("t_plain_sum") == 8 * 250 * sum(range(20))


def test_the_sidecar_exposes_the_step_series_from_the_start() -> None:
    registry = Metrics().registry
    assert registry.get_sample_value("nightjar_table_steps_total", {"result": "late"}) == 0
    assert registry.get_sample_value("nightjar_step_duration_seconds_count") == 0
    labels = {"batch_bucket": "256+", "le": "+Inf"}
    assert registry.get_sample_value("nightjar_gamma_chosen_bucket", labels) == 0
