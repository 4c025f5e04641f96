"""Learning only what ran, once (issue 54 item 5): against a real sidecar, a replayed or
duplicate report is skipped and counted, never learned again, and a ran step whose γ is
outside what its table decided or its engine allowed is refused with the real reason."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from nightjar_proto.v1 import admin_pb2, policy_pb2

from nightjar_common import wire
from nightjar_common.types import RanStep, StepContext, StepOutcome
from tests.rigs.outcomes import step_outcome
from tests.rigs.sidecar import EngineStream, ServerProcess

LEARNER = "m@cpu"


def context(step: int, max_gamma: int = 4, **extra: Any) -> StepContext:
    return StepContext(
        engine_id="e0",
        batch_size=4,
        step_index=step,
        previous_gamma=2 if step else None,
        max_gamma=max_gamma,
        context_tokens=1200,
        learner_key=LEARNER,
        **extra,
    )


def table_for(engine: EngineStream, ctx: StepContext) -> policy_pb2.GammaTable:
    reply = engine.send(policy_pb2.StepRequest(context=wire.context_to_pb(ctx)))
    return reply.table


def report(
    engine: EngineStream, steps: list[RanStep], outcomes: list[StepOutcome]
) -> policy_pb2.StepReply:
    return engine.send(
        policy_pb2.StepRequest(
            ran_steps=[wire.ran_step_to_pb(step) for step in steps],
            outcomes=[wire.outcome_to_pb(outcome) for outcome in outcomes],
        )
    )


def totals(server: ServerProcess) -> tuple[int, int]:
    """Decisions (committed steps) and outcomes applied, as GetState counts them."""
    reply = server.admin.GetState(admin_pb2.GetStateRequest(), metadata=server.auth, timeout=5)
    return int(reply.decisions_total), int(reply.reports_total)


def learner_steps(server: ServerProcess) -> int:
    learners = server.state()["state"]["learners"]
    return sum(int(learner["steps"]) for learner in learners.values())


def test_a_replayed_ran_step_and_outcome_are_learned_once(make_server: Any) -> None:
    server = make_server("--policy", "goodput", "--params", '{"seed": 3}')
    with server.engine() as engine:
        table = table_for(engine, context(0))
        gamma = table.gammas[4 - table.first_batch_size]
        step = RanStep(f"{table.table_id}.1", context(1), gamma)
        outcome = step_outcome(step.decision_id, "e0", gamma, 4)
        first = report(engine, [step], [outcome])
        assert first.skipped == 0
        replies = [report(engine, [step], [outcome]) for _ in range(19)]
    assert learner_steps(server) == 1
    assert totals(server) == (1, 1)
    for reply in replies:
        assert reply.skipped == 2  # the step and its outcome, each counted
        assert "already" in reply.skipped_reason and step.decision_id in reply.skipped_reason


def test_a_ran_step_twice_in_one_batch_is_committed_once(make_server: Any) -> None:
    server = make_server("--policy", "static", "--params", '{"gamma": 2}')
    with server.engine() as engine:
        table = table_for(engine, context(0))
        step = RanStep(f"{table.table_id}.1", context(1), 2)
        # A step number spelled with a leading zero names the same step.
        alias = dataclasses.replace(step, decision_id=f"{table.table_id}.01")
        reply = report(engine, [step, step, alias], [])
    assert reply.skipped == 2 and "already" in reply.skipped_reason
    assert totals(server) == (1, 0)


def test_a_duplicate_outcome_is_skipped_and_counted_not_dropped(make_server: Any) -> None:
    server = make_server("--policy", "static", "--params", '{"gamma": 2}')
    with server.engine() as engine:
        table = table_for(engine, context(0))
        ran = RanStep(f"{table.table_id}.1", context(1), 2)
        earlier = RanStep(f"{table.table_id}.2", context(2), 2)
        report(engine, [earlier], [])
        ran_outcome = step_outcome(ran.decision_id, "e0", 2, 4)
        earlier_outcome = step_outcome(earlier.decision_id, "e0", 2, 4)
        reply = report(engine, [ran], [ran_outcome, ran_outcome, earlier_outcome, earlier_outcome])
    assert reply.skipped == 2
    assert "duplicate" in reply.skipped_reason or "already" in reply.skipped_reason
    assert totals(server) == (2, 2)


@pytest.mark.parametrize(
    ("params", "decided", "ran", "gamma", "reason"),
    [
        # Γmax 4, the table decided for max_gamma 2: its entries are 2.
        ('{"gamma": 4}', {"max_gamma": 2}, {"max_gamma": 4}, 3, "above its table entry (2)"),
        ('{"gamma": 4}', {}, {"max_gamma": 2}, 3, "above the step's max_gamma (2)"),
        ('{"gamma": 4}', {}, {"draft_resident": False}, 1, "the draft is not resident"),
        ('{"gamma": 4}', {}, {"max_gamma": 8}, 5, "above the deciding policy's gamma_max (4)"),
    ],
    ids=["above-entry", "above-max-gamma", "draft-not-resident", "above-gamma-max"],
)
def test_a_ran_step_with_gamma_outside_what_was_decided_or_allowed_is_refused(
    make_server: Any,
    params: str,
    decided: dict[str, Any],
    ran: dict[str, Any],
    gamma: int,
    reason: str,
) -> None:
    server = make_server("--policy", "static", "--params", params)
    with server.engine() as engine:
        table = table_for(engine, dataclasses.replace(context(0), **decided))
        step = RanStep(f"{table.table_id}.1", dataclasses.replace(context(1), **ran), gamma)
        reply = report(engine, [step], [step_outcome(step.decision_id, "e0", gamma, 4)])
        # The same step at a γ it could run is learned: the refusal spent nothing.
        allowed = dataclasses.replace(step, gamma=0)
        again = report(engine, [allowed], [step_outcome(step.decision_id, "e0", 0, 4)])
    assert reply.skipped == 2  # the step, and its outcome (no decision awaits it)
    assert reason in reply.skipped_reason and step.decision_id in reply.skipped_reason
    assert "not held" not in reply.skipped_reason
    assert again.skipped == 0
    assert totals(server) == (1, 1)
