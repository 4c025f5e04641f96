"""The wire conversions the hot path uses: what goes out comes back the same."""

from __future__ import annotations

import dataclasses

from policy_server import wire
from policy_server.types import BinType, Decision, MemoryDirective, StepOutcome


def test_an_outcome_with_per_request_accepts_round_trips_in_order() -> None:
    accepts = tuple((f"cmpl-{i:032x}-0", i % 4) for i in range(64))
    outcome = StepOutcome("d-7", "engine-a", 3, 0.25, 160, drafted_tokens=192,
                          accepted_tokens=sum(n for _, n in accepts), request_accepts=accepts,
                          prefill_tokens=512, draft_gamma=2)  # fmt: skip
    assert wire.outcome_from_pb(wire.outcome_to_pb(outcome)) == outcome
    assert wire.outcome_from_pb(wire.outcome_to_pb(StepOutcome("d-8", "e", 0, 0.1, 4))) == (
        StepOutcome("d-8", "e", 0, 0.1, 4)
    )


def test_a_decision_converts_with_or_without_its_candidates() -> None:
    def decision(batch: int, gamma: int, **extra: object) -> Decision:
        return Decision(gamma, f"d-{batch}", BinType.EXPLOIT, 0.0, "goodput", "r1",
                        step_index=9, batch_size=batch, tentative=True, **extra)  # type: ignore[arg-type]  # fmt: skip

    directive = MemoryDirective("offload_draft_expand_kv", 1200, "kv pressure")
    asked = decision(8, 2, memory_directive=directive,
                     candidates=(decision(7, 2), decision(12, 1)))  # fmt: skip
    msg = wire.decision_to_pb(asked)
    assert wire.decision_from_pb(msg) == asked
    bare = wire.decision_from_pb(msg, candidates=False)
    assert bare == dataclasses.replace(asked, candidates=())
    assert wire.directive_from_pb(msg.memory_directive) == directive
