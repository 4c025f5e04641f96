"""The collector's pauses measured and the started sidecar's heap frozen (gc_pauses.py)."""

from __future__ import annotations

import gc
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from policy_server.gc_pauses import PAUSE_BUCKETS, PauseRecorder
from tests.policy_server.test_server import context
from tests.policy_server.test_stream_limits import metric, wait_for


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_each_collection_is_recorded_under_its_generation() -> None:
    recorder = PauseRecorder()
    recorder.install()
    recorder.install()  # once only: a second install records nothing twice
    try:
        gc.collect(2)
        gc.collect(1)
    finally:
        recorder.uninstall()
    gc.collect(2)  # after uninstall: not recorded
    assert sum(recorder.counts[2]) == 1 and recorder.sums[2] > 0
    assert sum(recorder.counts[1]) == 1 and recorder.sums[1] > 0
    registry = CollectorRegistry()
    registry.register(recorder)
    found = samples(registry)
    full = (("generation", "2"),)
    assert found[("nightjar_gc_pause_seconds_count", full)] == 1
    assert found[("nightjar_gc_pause_seconds_sum", full)] == recorder.sums[2]
    # Cumulative buckets: the pause lies in the first bucket whose bound is not below it.
    bounds = [b for b in PAUSE_BUCKETS if b >= recorder.sums[2]]
    for bound in PAUSE_BUCKETS:
        counted = found[
            ("nightjar_gc_pause_seconds_bucket", (("generation", "2"), ("le", repr(bound))))
        ]
        assert counted == (1 if bounds and bound >= bounds[0] else 0)
    assert found[("nightjar_gc_pause_seconds_bucket", (("generation", "2"), ("le", "+Inf")))] == 1
    assert found[("nightjar_gc_frozen_objects", ())] == gc.get_freeze_count()


def test_a_started_sidecar_freezes_its_heap_and_exports_its_pauses(make_server: Any) -> None:
    server = make_server()
    # The freeze follows the listeners (the sidecar is already answering).
    wait_for(lambda: metric(server, "nightjar_gc_frozen_objects") > 10_000, "frozen")
    engine = server.engine()
    for step in range(200):
        engine.decide(context("e1", 1 + step % 40, step_index=step))
    engine.close()
    assert metric(server, "nightjar_gc_pause_seconds_count") > 0  # generation 0's, first
