"""The wire conversions the hot path uses: what goes out comes back the same."""

from __future__ import annotations

import dataclasses

import pytest
from nightjar_proto.v1 import policy_pb2 as pb

from nightjar_common import wire
from nightjar_common.errors import InvalidArgumentError
from nightjar_common.types import (
    BinType,
    GammaTable,
    MemoryDirective,
    RanStep,
    StepContext,
    StepOutcome,
)


def test_an_outcome_with_per_request_accepts_round_trips_in_order() -> None:
    accepts = tuple(i % 4 for i in range(64))
    outcome = StepOutcome(
        "d-7",
        "engine-a",
        3,
        0.25,
        160,
        drafted_tokens=192,
        accepted_tokens=sum(accepts),
        request_accepts=accepts,
        prefill_tokens=512,
        draft_gamma=2,
    )
    msg = wire.outcome_to_pb(outcome)
    assert not msg.requests  # the packed form only
    assert wire.outcome_from_pb(msg) == outcome
    assert wire.outcome_from_pb(wire.outcome_to_pb(StepOutcome("d-8", "e", 0, 0.1, 4))) == (
        StepOutcome("d-8", "e", 0, 0.1, 4)
    )


def test_an_engine_older_than_v1_5_sends_accepts_with_request_ids() -> None:
    old = pb.StepOutcome(
        decision_id="d-1",
        engine_id="e",
        gamma=2,
        step_seconds=0.1,
        generated_tokens=5,
        drafted_tokens=4,
        accepted_tokens=1,
    )
    old.requests.add(request_id="cmpl-a", accepted_tokens=0)
    old.requests.add(request_id="cmpl-b", accepted_tokens=1)
    assert wire.outcome_from_pb(old).request_accepts == (0, 1)
    assert wire.outcome_from_pb(old).request_ids == ("cmpl-a", "cmpl-b")
    both = pb.StepOutcome()
    both.CopyFrom(old)
    both.request_accepted_tokens.extend([0, 1])
    with pytest.raises(InvalidArgumentError, match="not both"):
        wire.outcome_from_pb(both)


def test_a_table_converts_with_its_memory_directive_and_reason() -> None:
    directive = MemoryDirective("offload_draft_expand_kv", 1200, "kv pressure")
    table = GammaTable(
        "t-7", "static", "r1", 6, (2, 2, 2), (False,) * 3, True, 9, 8, 50.0,
        memory_directive=directive,
        reason=BinType.FIXED,
    )  # fmt: skip
    msg = wire.table_to_pb(table)
    assert wire.table_from_pb(msg) == table
    assert msg.reason == "fixed" and wire.directive_from_pb(msg.memory_directive) == directive
    # No action: no directive on the wire; an unknown reason reads as none.
    plain = dataclasses.replace(table, memory_directive=MemoryDirective(), reason=None)
    assert not wire.table_to_pb(plain).HasField("memory_directive")
    assert wire.table_from_pb(wire.table_to_pb(plain)) == plain
    msg.reason = "exploit"  # entries' kinds travel in `exploring`, not as a table reason
    assert wire.table_from_pb(msg).reason is None


def test_a_ran_step_round_trips_with_its_context() -> None:
    step = RanStep("t-7.3", StepContext("e", 12, step_index=4, context_tokens=800), 2)
    assert wire.ran_step_from_pb(wire.ran_step_to_pb(step)) == step
    exploited = dataclasses.replace(step, exploited=True)
    assert wire.ran_step_from_pb(wire.ran_step_to_pb(exploited)) == exploited


def test_a_tables_exploit_gammas_round_trip() -> None:
    table = GammaTable(
        "t-8", "goodput", "r1", 6, (2, 1, 3), (False, True, False), False, 9, 32, 50.0,
        exploit_gammas=(2, 3, 3),
    )  # fmt: skip
    assert wire.table_from_pb(wire.table_to_pb(table)) == table
    assert not wire.table_to_pb(dataclasses.replace(table, exploit_gammas=())).exploit_gammas


def test_a_context_round_trips_with_the_drafters_minimum_passes() -> None:
    ctx = StepContext(
        "e",
        48,
        step_index=7,
        max_gamma=3,
        context_tokens=9000,
        min_draft_passes=1,
    )
    assert wire.context_from_pb(wire.context_to_pb(ctx)) == ctx
    assert wire.context_from_pb(pb.StepContext(engine_id="e", batch_size=4)).min_draft_passes == 0


def test_per_request_fields_round_trip() -> None:
    """v1.8: labelled accepts go out as RequestAccepts (what a per-request policy reads),
    tables carry per-request γ and whether the policy reads the signals."""
    labelled = StepOutcome(
        "d-9", "e", 2, 0.1, 7, 4, 3, request_accepts=(2, 1), request_ids=("r1", "r2")
    )
    msg = wire.outcome_to_pb(labelled)
    assert [(r.request_id, r.accepted_tokens) for r in msg.requests] == [("r1", 2), ("r2", 1)]
    assert not msg.request_accepted_tokens
    assert wire.outcome_from_pb(msg) == labelled
    table = GammaTable(
        "t-1", "dsde", "v1", 3, (2, 2, 3), (False,) * 3, False, 5, 8, 50.0,
        request_gammas=(("r1", 1), ("r2", 3)),
        reads_request_signals=True,
        any_speculation_state=True,
    )  # fmt: skip
    assert wire.table_from_pb(wire.table_to_pb(table)) == table
