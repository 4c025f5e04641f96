"""The wire conversions the hot path uses: what goes out comes back the same."""

from __future__ import annotations

import dataclasses

import pytest
from nightjar_proto.v1 import policy_pb2 as pb

from nightjar_common import wire
from nightjar_common.errors import InvalidArgumentError
from nightjar_common.types import (
    BinType,
    Decision,
    GammaTable,
    MemoryDirective,
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


def test_a_decision_converts_with_or_without_its_candidates() -> None:
    def decision(batch: int, gamma: int, **extra: object) -> Decision:
        return Decision(
            gamma,
            f"d-{batch}",
            BinType.EXPLOIT,
            0.0,
            "goodput",
            "r1",
            step_index=9,
            batch_size=batch,
            tentative=True,
            **extra,
        )  # type: ignore[arg-type]

    directive = MemoryDirective("offload_draft_expand_kv", 1200, "kv pressure")
    asked = decision(8, 2, memory_directive=directive, candidates=(decision(7, 2), decision(12, 1)))
    msg = wire.decision_to_pb(asked)
    assert wire.decision_from_pb(msg) == asked
    bare = wire.decision_from_pb(msg, candidates=False)
    assert bare == dataclasses.replace(asked, candidates=())
    assert wire.directive_from_pb(msg.memory_directive) == directive


def test_a_context_round_trips_with_the_drafters_minimum_passes() -> None:
    ctx = StepContext(
        "e",
        48,
        step_index=7,
        max_gamma=3,
        context_tokens=9000,
        candidate_batch_sizes=(47, 49),
        min_draft_passes=1,
    )
    assert wire.context_from_pb(wire.context_to_pb(ctx)) == ctx
    assert wire.context_from_pb(pb.StepContext(engine_id="e", batch_size=4)).min_draft_passes == 0


def test_per_request_fields_round_trip() -> None:
    """v1.8: labelled accepts go out as RequestAccepts (what a per-request policy reads),
    tables and decisions carry per-request γ and whether the policy reads the signals."""
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
    decision = Decision(2, "d-1", BinType.EXPLOIT, 0.0, "dsde", "v1", request_gammas=(("r1", 1),))
    decision.reads_request_signals = True
    back = wire.decision_from_pb(wire.decision_to_pb(decision))
    assert back.reads_request_signals and back.request_gammas == (("r1", 1),)
