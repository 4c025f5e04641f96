"""What a client can make the sidecar hold is bounded: engines, learner keys, pending
decisions per engine (oldest evicted, counted), per-request sections and message size
(refused); and a flood of 100,000 distinct engine ids leaves a real server's RSS flat."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import grpc
import pytest
from nightjar_proto.v1 import admin_pb2, policy_pb2

from benchmarks import bounds_check
from nightjar_common.errors import InvalidArgumentError
from nightjar_common.types import RequestSignals, StepContext, StepOutcome
from policy_server.engines import Bounds
from policy_server.service import DecisionService


def evicted(service: DecisionService, kind: str) -> float:
    return float(service.metrics.evictions.labels(kind)._value.get())


def ctx(engine: str, key: str = "", **extra: Any) -> StepContext:
    return StepContext(engine_id=engine, batch_size=4, learner_key=key, **extra)


def test_engines_beyond_the_bound_evict_the_least_recently_used() -> None:
    service = DecisionService("nightjar", bounds=Bounds(max_engines=3))
    first = service.run_step(ctx("a"))
    decided = {engine: service.run_step(ctx(engine)) for engine in ("b", "c", "a", "d")}
    # "a" was used again, so "b" was the least recently used.
    assert sorted(service.state_view().engine_ids) == ["a", "c", "d"]
    assert evicted(service, "engine") == 1
    assert "b" not in service.state_view().state["engines"]  # its policy state went too
    assert service.report(StepOutcome(first.decision_id, "a", first.gamma, 0.01, 4)).skipped == 0
    service.run_step(ctx("e"))  # evicts "c", with its pending decision
    assert evicted(service, "engine") == 2
    gone = decided["c"]
    lost = service.report(StepOutcome(gone.decision_id, "c", gone.gamma, 0.01, 4))
    assert "unknown decision" in lost.skipped_reason


def test_learner_keys_beyond_the_bound_are_forgotten_and_counted() -> None:
    service = DecisionService("nightjar", bounds=Bounds(max_learner_keys=2))
    for i, key in enumerate(("k1", "k2", "k3")):
        decision = service.run_step(ctx(f"e{i}", key))
        service.report(StepOutcome(decision.decision_id, f"e{i}", decision.gamma, 0.01, 4))
    learners = service.state_view().state["learners"]
    assert "shared:k1" not in learners and {"shared:k2", "shared:k3"} <= set(learners)
    assert evicted(service, "learner_key") == 1


def test_pending_decisions_per_engine_are_bounded() -> None:
    service = DecisionService("static", bounds=Bounds(max_pending_per_engine=4))
    decisions = [service.run_step(ctx("e")) for _ in range(6)]
    assert evicted(service, "pending") == 2
    oldest = service.report(StepOutcome(decisions[0].decision_id, "e", 1, 0.01, 4))
    assert "(evicted)" in oldest.skipped_reason  # the oldest two were evicted
    assert service.report(StepOutcome(decisions[-1].decision_id, "e", 1, 0.01, 4)).skipped == 0


def test_per_request_sections_are_bounded() -> None:
    service = DecisionService("static")
    limits = service.limits
    many = tuple(RequestSignals(f"r{i}") for i in range(limits.max_requests + 1))
    with pytest.raises(InvalidArgumentError, match="per-request sections"):
        service.run_step(ctx("e", requests=many))
    long = (RequestSignals("r", recent_accepts=(1,) * (limits.max_recent_accepts + 1)),)
    with pytest.raises(InvalidArgumentError, match="recent_accepts"):
        service.run_step(ctx("e", requests=long))
    assert service.state_view().decisions_total == 0


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (RequestSignals("r" * 257), "request_id is longer"),
        (RequestSignals("r", context_tokens=-1), "negative token counts"),
        (RequestSignals("r", recent_accepts=(2, -1, 3)), "negative token counts"),
        (RequestSignals("r", kl_divergence=-0.5), "kl_divergence must be finite"),
        (RequestSignals("r", draft_entropy=math.inf), "draft_entropy must be finite"),
        (RequestSignals("r", kl_divergence=0.1, draft_entropy=math.nan), "draft_entropy"),
    ],
)
def test_each_bad_request_section_is_refused_after_good_ones(
    request_: RequestSignals, message: str
) -> None:
    service = DecisionService("static")
    good = (RequestSignals("a", 10, (0, 3), 0.2, 1.5), RequestSignals("b"))
    with pytest.raises(InvalidArgumentError, match=message):
        service.run_step(ctx("e", requests=(*good, request_)))
    assert service.run_step(ctx("e", requests=good)).gamma >= 0
    assert service.state_view().decisions_total == 1


@pytest.mark.parametrize(
    ("accepts", "ids", "message"),
    [
        ((1, 3), ("a", "b"), "per-request accepted_tokens must be in 0..gamma"),
        ((-1, 1), ("a", "b"), "per-request accepted_tokens must be in 0..gamma"),
        ((1, 1), ("a", "b" * 257), "request_id is longer"),
    ],
)
def test_each_bad_per_request_outcome_is_refused(
    accepts: tuple[int, ...], ids: tuple[str, ...], message: str
) -> None:
    service = DecisionService("static")
    decision = service.run_step(ctx("e"))
    bad = StepOutcome(
        decision.decision_id,
        "e",
        2,
        0.01,
        6,
        drafted_tokens=4,
        accepted_tokens=4,
        request_accepts=accepts,
        request_ids=ids,
    )
    refused = service.report(bad)
    assert refused.malformed == 1 and message in refused.skipped_reason
    good = dataclasses.replace(bad, request_accepts=(2, 2), request_ids=("a", "b"))
    assert service.report(good).skipped == 0


def test_oversized_message_is_refused_by_the_server(make_server: Any) -> None:
    server = make_server("--policy", "static")
    huge = policy_pb2.StepContext(engine_id="e", batch_size=1, learner_key="x" * (5 << 20))
    with pytest.raises(grpc.RpcError) as error:
        # The stream's policy notice may come first; the oversized request ends the stream.
        list(server.policy.StepStream(iter([policy_pb2.StepRequest(seq=1, context=huge)])))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert server.state()["reports"] == 0
    seen = server.admin.GetState(admin_pb2.GetStateRequest(), metadata=server.auth, timeout=5)
    assert list(seen.engine_ids) == []  # nothing of it was read
    with server.engine() as engine:  # another stream is served as before
        assert engine.decide(policy_pb2.StepContext(engine_id="e", batch_size=1)).gamma >= 0


def test_a_flood_of_engine_ids_leaves_rss_flat_and_is_counted() -> None:
    """The check `make bounds-check` runs, at full size: 100,000 distinct engine ids."""
    result = bounds_check.run(100_000, sample_every=20_000)
    assert result.errors == 0
    assert result.evictions["engine"] >= 100_000 - Bounds().max_engines
    assert result.evictions["learner_key"] >= 100_000 - Bounds().max_learner_keys
    limit = result.rss_full_bytes * (1 + bounds_check.GROWTH_LIMIT) + bounds_check.SLACK_BYTES
    assert result.rss_end_bytes <= limit, result.rss_samples
    assert result.passed
