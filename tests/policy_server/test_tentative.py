"""Tentative decisions: a table decides γ for every batch size the engine's next steps
may have, the engine runs one entry a step, and the sidecar learns from that one only.

Checked against the policy asked for each step alone with the same seed and the same
information: the γ of every step and the whole learned state (schedules, RNG, goodput
tables) must be identical, for every registered policy. Also, through a real server
process: a stream used a step at a time learns exactly what the service learns in
process from the same requests.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from nightjar_proto.v1 import policy_pb2

from nightjar_common import wire
from nightjar_common.sidecar_stream import SyncStream
from nightjar_common.types import BinType, Choice, RanStep, StepContext, StepOutcome
from policy_server.policies import REGISTRY, create_policy, learned_state
from policy_server.service import DecisionService
from tests.rigs.outcomes import step_outcome

STEPS = 400


def batch_walk(seed: int, steps: int) -> list[int]:
    """Batch sizes that move by a request or two, sometimes jump (a burst admitted)."""
    rng = random.Random(seed)
    sizes, size = [], 6
    for _ in range(steps):
        move = rng.choice((-2, -1, 0, 0, 0, 1, 2, 9)) if rng.random() < 0.5 else 0
        size = min(40, max(1, size + move))
        sizes.append(size)
    return sizes


def context(step: int, batch: int) -> StepContext:
    return StepContext(
        engine_id="e0",
        learner_key="tiny@cpu",
        batch_size=batch,
        step_index=step,
        free_kv_blocks=500,
        total_kv_blocks=1000,
    )


def made(policy: str) -> dict[str, Any] | None:
    return {"seed": 7} if "seed" in REGISTRY[policy].default_params() else None


def outcome_of(decision_id: str, gamma: int, ctx: StepContext) -> StepOutcome:
    return step_outcome(decision_id, ctx.engine_id, gamma, ctx.batch_size)


def alone_run(policy: str, sizes: list[int]) -> tuple[list[int], dict[str, Any]]:
    """The policy asked for each step alone, learning each outcome three steps late (as
    the table run below does)."""
    decider = create_policy(policy, made(policy))
    ran: list[tuple[StepContext, Choice]] = []
    for step, batch in enumerate(sizes):
        if step >= 3:
            ctx, choice = ran[step - 3]
            decider.observe(ctx, choice, outcome_of("-", choice.gamma, ctx))
        ctx = context(step, batch)
        ran.append((ctx, decider.decide(ctx)))
    return [choice.gamma for _, choice in ran], learned_state(decider).state()


def table_run(policy: str, sizes: list[int]) -> tuple[list[int], DecisionService, int]:
    """A table per step asked for with the previous step's batch size (what the engine
    knows when it asks ahead); the step runs the entry for the batch size it turned out
    to have (a table asked for afresh when it is outside), reported with the next request
    with the outcome of three steps back."""
    service = DecisionService(policy, made(policy))
    gammas: list[int] = []
    ran: list[tuple[str, int, StepContext]] = []
    pending: list[RanStep] = []
    off_table = 0
    for step, batch in enumerate(sizes):
        report = [outcome_of(*ran[step - 3])] if step >= 3 else []
        asked = context(step, sizes[step - 1] if step else batch)
        table = service.table_step(pending, report, asked).table
        assert table is not None
        index = batch - table.first_batch_size
        if not 0 <= index < len(table.gammas):
            off_table += 1
            table = service.table_step((), (), context(step, batch)).table
            assert table is not None
            index = batch - table.first_batch_size
        decision_id, gamma = f"{table.table_id}.1", table.gammas[index]
        gammas.append(gamma)
        ran.append((decision_id, gamma, context(step, batch)))
        pending = [RanStep(decision_id, context(step, batch), gamma)]
    assert service.table_step(pending, (), None).skipped == 0
    return gammas, service, off_table


@pytest.mark.parametrize("policy", sorted(REGISTRY))
def test_tables_learn_exactly_what_deciding_each_step_alone_learns(policy: str) -> None:
    """Of a table's entries only the one a step ran may count: schedules, RNG draws and
    γ_prev advance as if the policy had been asked for that step alone, for every
    registered policy (TentativeDecisions, or the copies of a policy without it)."""
    sizes = batch_walk(seed=3, steps=STEPS)
    alone_gammas, alone_state = alone_run(policy, sizes)
    table_gammas, service, off_table = table_run(policy, sizes)
    assert table_gammas == alone_gammas
    assert service.state_view().state == alone_state
    assert service.state_view().decisions_total == STEPS
    # Most steps ran an entry decided for another batch size than the table's context.
    moved = sum(1 for a, b in itertools.pairwise(sizes) if a != b)
    assert off_table < moved / 2


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


class _RoundRobin:
    """A policy without TentativeDecisions: each decide() moves to the next γ."""

    name = "round-robin"
    gamma_max = 3

    def __init__(self) -> None:
        self.turn = 0

    def params(self) -> dict[str, Any]:
        return {}

    def decide(self, ctx: StepContext) -> Choice:
        self.turn += 1
        return Choice(gamma=self.turn % 4, bin_type=BinType.EXPLORE)

    def observe(self, ctx: StepContext, choice: Choice, outcome: StepOutcome) -> None:
        return None


def test_a_policy_without_tentative_decisions_is_decided_on_copies() -> None:
    """Its table's entries are decided on copies of it, and the entry a step runs again on
    the live policy: it advances once a step, as if asked for that step alone."""
    service = DecisionService("static")
    with service.activation.whole_policy():
        active = service.activation.activate(_RoundRobin(), "swap", "fresh")
    assert active.tentative is None
    ran = [service.run_step(context(step, 4)).gamma for step in range(6)]
    assert ran == [1, 2, 3, 0, 1, 2]
    assert isinstance(active.policy, _RoundRobin) and active.policy.turn == 6
