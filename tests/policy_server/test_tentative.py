"""Multi-candidate prefetch: the engine asks ahead for every batch size its next step may
have, runs one, and the sidecar learns from that one only.

Checked against a blocking run with the same seed and the same information (each request
carries the outcome of two steps back, as a pipelined engine would): the γ of every step
and the whole learned state (schedules, RNG, goodput tables) must be identical, for every
registered policy. Also, through a real server process: a stream used a step at a time
learns exactly what the service learns in process from the same requests.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from nightjar_proto.v1 import policy_pb2

from nightjar_common import wire
from nightjar_common.errors import NotFoundError
from nightjar_common.sidecar_stream import SyncStream
from nightjar_common.types import Decision, RanStep, StepContext, StepOutcome
from policy_server.policies import REGISTRY
from policy_server.service import DecisionService
from tests.rigs.outcomes import step_outcome

STEPS = 400


def candidate_window(batch: int) -> tuple[int, ...]:
    """The batch sizes around ``batch`` a step may turn out to have."""
    return tuple(size for size in range(batch - 6, batch + 9) if size >= 1 and size != batch)


def batch_walk(seed: int, steps: int) -> list[int]:
    """Batch sizes that move by a request or two, sometimes jump (a burst admitted)."""
    rng = random.Random(seed)
    sizes, size = [], 6
    for _ in range(steps):
        move = rng.choice((-2, -1, 0, 0, 0, 1, 2, 9)) if rng.random() < 0.5 else 0
        size = min(40, max(1, size + move))
        sizes.append(size)
    return sizes


def outcome(decision: Decision, ctx: StepContext) -> StepOutcome:
    return step_outcome(decision.decision_id, ctx.engine_id, decision.gamma, ctx.batch_size)


def context(step: int, batch: int, **extra: Any) -> StepContext:
    return StepContext(
        engine_id="e0",
        learner_key="tiny@cpu",
        batch_size=batch,
        step_index=step,
        free_kv_blocks=500,
        total_kv_blocks=1000,
        **extra,
    )


def blocking_run(policy: str, sizes: list[int]) -> tuple[list[int], DecisionService]:
    service = DecisionService(policy, {"seed": 7} if "seed" in _defaults(policy) else None)
    gammas: list[int] = []
    ran: list[tuple[Decision, StepContext]] = []
    for step, batch in enumerate(sizes):
        report = outcome(*ran[step - 3]) if step >= 3 else None
        ctx = context(step, batch)
        decision = service.step(report, ctx)
        assert decision is not None and not decision.tentative
        gammas.append(decision.gamma)
        ran.append((decision, ctx))
    service.report(outcome(*ran[-3]))  # what the prefetch run's last request carries
    return gammas, service


def prefetch_run(policy: str, sizes: list[int]) -> tuple[list[int], DecisionService, int]:
    """What the pipelined client does: ask for step t while step t-1 runs, for the batch
    of step t-1 and its candidate window; take the answer for the batch that ran."""
    service = DecisionService(policy, {"seed": 7} if "seed" in _defaults(policy) else None)
    gammas: list[int] = []
    ran: list[tuple[Decision, StepContext]] = []
    hits, ran_id = 0, ""
    asked: Decision | None = None
    for step, batch in enumerate(sizes):
        chosen = None
        if asked is not None:
            chosen = next((d for d in (asked, *asked.candidates) if d.batch_size == batch), None)
        if chosen is None:  # outside the window: ask for this batch, and wait
            chosen = service.decide(context(step, batch))
        else:
            hits += 1
            ran_id = chosen.decision_id if chosen.tentative else ""
        gammas.append(chosen.gamma)
        ran.append((chosen, context(step, batch)))
        # Ask ahead for step+1 now, carrying the name of what runs now and the outcome of
        # two steps back (so step t is decided knowing outcomes up to t-3, as above).
        report = outcome(*ran[step - 2]) if step >= 2 else None
        window = candidate_window(batch)
        asked = service.step(
            report,
            context(step + 1, batch, candidate_batch_sizes=window, ran_decision_id=ran_id),
        )
        ran_id = ""
    return gammas, service, hits


def _defaults(policy: str) -> dict[str, Any]:
    return REGISTRY[policy].default_params()


@pytest.mark.parametrize("policy", sorted(REGISTRY))
def test_prefetch_learns_exactly_what_a_blocking_run_learns(policy: str) -> None:
    sizes = batch_walk(seed=3, steps=STEPS)
    blocking_gammas, blocking = blocking_run(policy, sizes)
    prefetch_gammas, prefetch, hits = prefetch_run(policy, sizes)
    assert prefetch_gammas == blocking_gammas
    assert prefetch.state_view().state == blocking.state_view().state
    assert prefetch.state_view().decisions_total == blocking.state_view().decisions_total
    assert prefetch.state_view().reports_total == blocking.state_view().reports_total
    # Most steps moved within the window and found their answer ahead (policies without
    # checkpoints too: their candidates are decided on a copy).
    assert hits >= 0.8 * STEPS
    dropped = prefetch.metrics.tentative.labels("dropped")._value.get()
    assert dropped > STEPS  # the other candidates were decided, and dropped


def test_a_dropped_candidate_cannot_be_reported() -> None:
    service = DecisionService("nightjar", {"seed": 1})
    asked = service.decide(context(0, 4, candidate_batch_sizes=(3, 5)))
    assert asked.tentative and sorted(c.batch_size for c in asked.candidates) == [3, 5]
    ran, other = asked.candidates
    service.decide(context(1, ran.batch_size, ran_decision_id=ran.decision_id))
    with pytest.raises(NotFoundError):
        service.report(outcome(other, context(0, other.batch_size)))
    assert service.report(outcome(ran, context(0, ran.batch_size)))
    # An outcome naming a still-open candidate commits it (the report names what ran).
    ahead = service.decide(context(2, 4, candidate_batch_sizes=(6,)))
    named = ahead.candidates[0]
    before = service.state_view().decisions_total
    assert service.report(outcome(named, context(2, 6)))
    assert service.state_view().decisions_total == before + 1


def test_over_grpc_a_step_at_a_time_learns_what_the_service_learns_in_process(
    make_server: Any,
) -> None:
    """Raw nightjar.v1 messages on one stream, a step at a time: each step run from the
    table sent for its context, reported (the ran step and its outcome) with the next
    request. The sidecar runs the same γ sequence as the service given the same requests in
    process, and learns the same state: nothing is lost or changed on the wire."""
    server = make_server("--policy", "nightjar", "--params", '{"seed": 5}')
    local = DecisionService("nightjar", {"seed": 5})
    remote_ran: list[policy_pb2.RanStep] = []
    remote_outcomes: list[policy_pb2.StepOutcome] = []
    local_ran: list[RanStep] = []
    local_outcomes: list[StepOutcome] = []
    with SyncStream(server.channel) as stream:
        for step, batch in enumerate(batch_walk(seed=9, steps=40)):
            ctx = policy_pb2.StepContext(
                engine_id="old",
                batch_size=batch,
                step_index=step,
                total_kv_blocks=100,
                draft_resident=True,
            )
            reply = stream.send(
                policy_pb2.StepRequest(context=ctx, ran_steps=remote_ran, outcomes=remote_outcomes)
            )
            assert not reply.HasField("error") and reply.skipped == 0
            expected = local.table_step(local_ran, local_outcomes, wire.context_from_pb(ctx))
            assert expected.skipped == 0 and expected.table is not None
            table, want = reply.table, expected.table
            assert table.first_batch_size == want.first_batch_size
            assert tuple(table.gammas) == want.gammas
            gamma = table.gammas[batch - table.first_batch_size]
            fields = dict(
                engine_id="old",
                gamma=gamma,
                step_seconds=0.02,
                generated_tokens=batch + gamma,
            )
            remote_id, local_id = f"{table.table_id}.1", f"{want.table_id}.1"
            remote_ran = [policy_pb2.RanStep(decision_id=remote_id, context=ctx, gamma=gamma)]
            remote_outcomes = [policy_pb2.StepOutcome(decision_id=remote_id, **fields)]
            local_ran = [RanStep(local_id, wire.context_from_pb(ctx), gamma)]
            local_outcomes = [StepOutcome(decision_id=local_id, **fields)]
    assert server.state()["reports"] == 39
    assert server.state()["state"] == local.state_view().state
