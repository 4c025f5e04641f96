"""Decision tables (nightjar.v1.7): the service decides a table of γ per batch size at
once, applies the steps an engine ran from it and their outcomes in batches, and takes
malformed or unknown items of a batch one by one; the client answers steps from the
table it holds. Through the service in process, and over gRPC against a real sidecar."""

from __future__ import annotations

import dataclasses
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from nightjar_proto.v1 import admin_pb2, policy_pb2

from nightjar_common import wire
from nightjar_common.client import (
    REPORT_BATCH_OUTCOMES,
    TABLE_REFRESH_MS,
    ClientConfig,
    NightjarClient,
)
from nightjar_common.errors import InvalidArgumentError
from nightjar_common.sidecar_stream import PendingReply
from nightjar_common.tables import SPENT, NextStep, TableCache, refresh_due
from nightjar_common.types import GammaTable, RanStep, StepContext, StepOutcome
from policy_server.metrics import DECISIONS, REPORTS, TABLE_STEPS
from policy_server.policies import create_policy
from policy_server.service import DecisionService
from tests.rigs.outcomes import step_outcome
from tests.rigs.sidecar import StepRejected


def context(step: int, batch: int, previous: int | None = None, **extra: Any) -> StepContext:
    return StepContext(
        engine_id="e0",
        batch_size=batch,
        step_index=step,
        previous_gamma=previous,
        max_gamma=4,
        context_tokens=300 * batch,
        **extra,
    )


def outcome(decision_id: str, gamma: int, batch: int) -> StepOutcome:
    return step_outcome(decision_id, "e0", gamma, batch)


def test_a_table_holds_the_policys_tentative_decisions() -> None:
    """The table for a context is what the policy decides for its batch sizes at once
    (TentativeDecisions): the same policy, the same draw, one entry per size."""
    ctx = context(0, 20, previous=2)
    table = DecisionService("goodput", {"seed": 5}).table_step([], [], ctx).table
    assert table is not None
    assert (table.first_batch_size, len(table.gammas), table.speculation_off) == (5, 24, False)
    policy = create_policy("goodput", {"seed": 5})
    decided = policy.decide_candidates(ctx, range(5, 29))  # type: ignore[attr-defined]
    assert [choice.gamma for choice, _ in decided] == list(table.gammas)
    assert [choice.exploration for choice, _ in decided] == list(table.exploring)
    assert table.policy_name == "goodput" and table.policy_version


def test_a_table_reaches_as_far_as_the_batch_may_move() -> None:
    """Below, as far as three quarters of the batch may finish at once (at least 8 sizes,
    at most 16); above, 8 sizes plus one per waiting request (at most 24 more): a backlog
    being admitted grows the batch."""
    service = DecisionService("goodput", {"seed": 5})
    cases = {  # (batch, waiting): (first size, last size)
        (4, 0): (1, 12),
        (20, 0): (5, 28),
        (20, 3): (5, 31),
        (20, 50): (5, 52),
        (64, 0): (48, 72),
        (64, 96): (48, 96),
    }
    for (batch, waiting), (first, last) in cases.items():
        ctx = dataclasses.replace(context(0, batch, previous=2), num_waiting=waiting)
        table = service.table_step([], [], ctx).table
        assert table is not None
        covered = (table.first_batch_size, table.first_batch_size + len(table.gammas) - 1)
        assert covered == (first, last), (batch, waiting)


def test_ran_steps_and_outcomes_are_learned_like_decisions() -> None:
    service = DecisionService("goodput", {"seed": 1})
    cache = TableCache()
    seq, ran, outcomes, previous, exploited = 0, [], [], None, 0
    for step in range(200):
        ctx = context(step, 8 + step % 5, previous)
        if refresh_due(cache.held, ctx.batch_size, ctx.previous_gamma == 0, 0.0, 8, float("inf")):
            seq += 1
            result = service.table_step(ran, outcomes, ctx)
            assert result.skipped == 0 and result.table is not None
            cache.install(result.table, seq)
            ran, outcomes = [], []
        taken = cache.take(ctx, 0.0)
        if taken == SPENT or isinstance(taken, str):
            seq += 1
            result = service.table_step(ran, outcomes, ctx)
            assert result.table is not None
            cache.install(result.table, seq)
            ran, outcomes = [], []
            taken = cache.take(ctx, 0.0)
        assert not isinstance(taken, str)
        ran.append(RanStep(taken.decision_id, ctx, taken.gamma, taken.exploited))
        exploited += taken.exploited
        outcomes.append(outcome(taken.decision_id, taken.gamma, ctx.batch_size))
        previous = taken.gamma
    service.table_step(ran, outcomes, None)
    view = service.state_view()
    assert view.decisions_total == 200 and view.reports_total == 200
    committed = service.metrics.steps.value(TABLE_STEPS, ("committed",))
    assert committed == 200
    assert service.metrics.tables._value.get() < 200 / 2  # tables serve several steps
    assert view.state["learners"]  # it learned
    # Steps after an exploring entry ran took its exploit γ from the same table.
    assert exploited > 0


def test_bad_items_are_skipped_one_by_one_and_the_rest_applied() -> None:
    service = DecisionService("static", {"gamma": 2})
    table = service.table_step([], [], context(0, 4)).table
    assert table is not None
    good = [RanStep(f"{table.table_id}.{n}", context(n, 4, 2), 2) for n in (1, 2, 3)]
    bad_id = RanStep("no-dot", context(4, 4, 2), 2)
    other_engine = RanStep(
        f"{table.table_id}.9", dataclasses.replace(context(4, 4), engine_id="x"), 2
    )
    unknown_table = RanStep("feedface-1.1", context(5, 4, 2), 2)
    outcomes = [outcome(step.decision_id, 2, 4) for step in good]
    too_many_accepted = dataclasses.replace(outcomes[0], decision_id="x.1", accepted_tokens=99)
    result = service.table_step(
        [good[0], bad_id, good[1], other_engine, good[2], unknown_table],
        [*outcomes, too_many_accepted, outcome("never-issued.3", 2, 4)],
        context(6, 4, 2),
    )
    assert result.skipped == 5 and "not '<table_id>.<n>'" in result.skipped_reason
    assert result.table is not None
    view = service.state_view()
    assert view.decisions_total == 3 and view.reports_total == 3
    assert service.metrics.steps.value(TABLE_STEPS, ("unknown",)) == 1
    assert service.metrics.skipped_outcomes._value.get() == 1


def test_an_implausible_batched_outcome_is_skipped_and_nothing_learns_from_it() -> None:
    """More drafts than the step's γ and batch allow: skipped and counted like a malformed
    item; the learner ends as if it never came, and its decision still awaits an outcome."""
    services = [DecisionService("goodput", {"seed": 5}) for _ in range(2)]
    for service, with_bad in zip(services, (False, True), strict=True):
        table = service.table_step([], [], context(0, 4)).table
        assert table is not None
        steps = [RanStep(f"{table.table_id}.{n}", context(n, 4, 2), 2) for n in (1, 2)]
        outcomes = [outcome(steps[0].decision_id, 2, 4)]
        if with_bad:
            bad = dataclasses.replace(outcome(steps[1].decision_id, 2, 4), drafted_tokens=10**6)
            outcomes.append(bad)
        result = service.table_step(steps, outcomes, None)
        assert (result.skipped, result.malformed) == ((1, 1) if with_bad else (0, 0))
    assert "exceeds gamma (2) times the decision's batch size (4)" in result.skipped_reason
    assert services[1].metrics.skipped_outcomes._value.get() == 1
    assert services[1].state_view().state == services[0].state_view().state
    late = outcome(steps[1].decision_id, 2, 4)
    assert services[1].table_step([], [late], None).skipped == 0


def test_a_malformed_context_rejects_the_request_before_anything_is_applied() -> None:
    service = DecisionService("static", {"gamma": 2})
    table = service.table_step([], [], context(0, 4)).table
    assert table is not None
    ran = [RanStep(f"{table.table_id}.1", context(1, 4, 2), 2)]
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        service.table_step(ran, [], context(2, 0, 2))
    assert service.state_view().decisions_total == 0
    with pytest.raises(InvalidArgumentError, match="more than 256"):
        service.table_step(ran * 257, [], context(2, 4, 2))


def test_steps_of_a_table_decided_before_a_swap_count_as_stale() -> None:
    service = DecisionService("static", {"gamma": 2})
    table = service.table_step([], [], context(0, 4)).table
    assert table is not None
    service.swap("off", None, keep_state=False)
    step = RanStep(f"{table.table_id}.1", context(1, 4, 2), 2)
    after = service.table_step([step], [outcome(step.decision_id, 2, 4)], context(2, 4, 2))
    assert after.table is not None and after.table.gammas == (0,) * len(after.table.gammas)
    assert after.table.reason is not None and after.table.reason.value == "fixed"
    assert service.metrics.steps.value(TABLE_STEPS, ("stale",)) == 1
    assert service.metrics.steps.value(REPORTS, ("off", "stale")) == 1


@pytest.mark.parametrize("policy", ["goodput", "nightjar"])
def test_a_table_answers_either_speculation_state_where_the_policy_prices_no_catch_up(
    policy: str, tmp_path: Path
) -> None:
    """v1.9: without a c_prefill table the speculation state a step starts in enters no
    decision (the tables for either state are the same), so the table says it serves both
    and a step after γ = 0 runs from it instead of asking again; with one, a table serves
    its own state only, as does one of a policy that does not say (``ema``)."""
    c_prefill = tmp_path / "c_prefill.csv"
    c_prefill.write_text(
        "lag_tokens,batch_size,c_prefill_ms\n"
        + "".join(f"{lag},{bs},{lag / 16}\n" for lag in (128, 4096) for bs in (4, 128))
    )

    def decided(name: str, params: dict[str, Any], previous: int) -> GammaTable:
        ctx = context(0, 20, previous=previous, max_draft_lag_tokens=512)
        table = DecisionService(name, params).table_step([], [], ctx).table
        assert table is not None
        return table

    free = decided(policy, {"seed": 5}, previous=2)
    assert free.any_speculation_state and not free.speculation_off
    assert decided(policy, {"seed": 5}, previous=0).gammas == free.gammas
    cache = TableCache()
    cache.install(free, 1)
    taken = cache.take(context(1, 20, 0), 0.0)  # after a step at γ = 0
    assert not isinstance(taken, str) and taken.gamma == free.gammas[20 - free.first_batch_size]
    assert not refresh_due(cache.held, 21, True, 0.0, 8, 1e9)
    priced = decided(policy, {"seed": 5, "prefill_cost_table": str(c_prefill)}, previous=2)
    assert not priced.any_speculation_state
    for table in (priced, decided("ema", {}, previous=2)):
        assert not table.any_speculation_state
        cache = TableCache()
        cache.install(table, 1)
        assert cache.take(context(1, 20, 0), 0.0) == "speculation_state"
        assert refresh_due(cache.held, 21, True, 0.0, 8, 1e9)


def test_a_table_is_for_one_speculation_state_and_its_exploring_entries_run_once() -> None:
    table = GammaTable(
        table_id="t",
        policy_name="p",
        policy_version="v",
        first_batch_size=3,
        gammas=(1, 2, 3, 3, 3, 3),
        exploring=(False, True, False, False, False, False),
        speculation_off=False,
        step_index=0,
        valid_steps=3,
        valid_ms=1000.0,
    )
    cache = TableCache()
    assert cache.install(table, 2) and not cache.install(table, 1)  # an older answer
    assert not cache.install(table, 2)  # the same answer again (waiter and callback)
    assert cache.take(context(0, 2, 1), 0.0) == "batch_size"
    assert cache.take(context(0, 3, 0), 0.0) == "speculation_state"
    first = cache.take(context(0, 4, 1), 0.0)
    assert not isinstance(first, str) and first.exploring and first.gamma == 2
    assert cache.take(context(1, 4, 2), 0.0) == SPENT
    assert refresh_due(cache.held, 4, False, 0.0, 8, 1e9)
    assert not refresh_due(cache.held, 5, False, 0.0, 8, 1e9)
    # The step after one at batch size 5, by the γ it ran at: the context only on demand.
    after = NextStep(context(0, 5, 1), gamma=0)
    assert (after.batch_size, after.speculation_off) == (5, True)  # speculation turned off
    assert refresh_due(cache.held, after.batch_size, after.speculation_off, 0.0, 8, 1e9)
    resumed = NextStep(context(0, 5, 0), gamma=2)
    assert (resumed.batch_size, resumed.speculation_off) == (5, False)
    assert after.context() == context(1, 5, 0)
    assert not isinstance(cache.take(context(1, 5, 2), 0.0), str)
    assert not isinstance(cache.take(context(2, 3, 2), 0.0), str)
    assert cache.take(context(3, 3, 2), 0.0) == "used_up"  # valid_steps = 3
    cache.held.uses = 0  # type: ignore[union-attr]
    assert cache.take(context(3, 3, 2), 5.0) == "expired"  # valid_ms = 1 s
    # Its steps are reported after a policy change voids it, not after a lost connection.
    cache.held.uses = 0  # type: ignore[union-attr]
    taken = cache.take_size(5, False, 0.5)
    assert not isinstance(taken, str) and taken.decision_id == "t.1"
    cache.void()
    assert cache.held is None and cache.current(taken.held)
    cache.forget()
    assert not cache.current(taken.held)
    assert cache.install(table, 3) and cache.current(cache.held)  # type: ignore[arg-type]


def test_a_spent_exploring_entry_runs_its_exploit_gamma_from_the_same_table() -> None:
    """Exploring once costs no new table: a table that names each entry's exploit γ
    answers the steps after the exploration with it, reported as exploited."""
    table = GammaTable(
        table_id="t",
        policy_name="p",
        policy_version="v",
        first_batch_size=1,
        gammas=(3, 3, 1, 2, 3, 4, *(3,) * 6),  # 1..12
        exploring=(False, False, False, True, False, True, *(False,) * 6),
        speculation_off=False,
        step_index=0,
        valid_steps=8,
        valid_ms=1000.0,
        exploit_gammas=(3, 3, 1, 3, 3, -1, *(3,) * 6),  # at 6 a trial: none
    )
    cache = TableCache()
    cache.install(table, 1)
    explored = cache.take(context(0, 4, 1), 0.0)
    assert not isinstance(explored, str) and explored.exploring and explored.gamma == 2
    assert not explored.exploited
    assert not refresh_due(cache.held, 4, False, 0.0, 8, 1e9)
    exploited = [cache.take(context(n, 4, 2), 0.0) for n in (1, 2)]
    assert [(s.gamma, s.exploring, s.exploited) for s in exploited] == [(3, False, True)] * 2  # type: ignore[union-attr]
    other = cache.take(context(3, 3, 3), 0.0)
    assert not isinstance(other, str) and not other.exploited and other.gamma == 1
    trial = cache.take(context(4, 6, 1), 0.0)
    assert not isinstance(trial, str) and trial.exploring and trial.gamma == 4
    assert cache.take(context(5, 6, 4), 0.0) == SPENT
    assert refresh_due(cache.held, 6, False, 0.0, 8, 1e9)


def test_a_step_run_at_its_exploit_gamma_commits_the_exploit() -> None:
    """The sidecar commits an exploited step as the exploiting choice and refuses, with
    the reason, an exploited step its table did not allow."""
    service = DecisionService("goodput", {"seed": 3, "warmup_steps": 0})
    env_steps = 0
    table = None
    while table is None or not [
        g for e, g in zip(table.exploring, table.exploit_gammas, strict=False) if e and 0 <= g < 4
    ]:
        ctx = context(env_steps, 6, 2)
        step = service.run_step(ctx)
        service.report(outcome(step.decision_id, step.gamma, 6))
        env_steps += 1
        table = service.table_step([], [], context(env_steps, 6, step.gamma)).table
        assert env_steps < 200, "no exploring table"
    assert table.exploit_gammas and len(table.exploit_gammas) == len(table.gammas)
    row = next(i for i, e in enumerate(table.exploring) if e and 0 <= table.exploit_gammas[i] < 4)
    size = table.first_batch_size + row
    exploit = table.exploit_gammas[row]
    ctx = context(env_steps, size, table.gammas[row])
    too_far = RanStep(f"{table.table_id}.1", ctx, exploit + 1, exploited=True)
    refused = service.table_step([too_far], [], None)
    assert refused.malformed == 1 and "above its table entry's exploit γ" in refused.skipped_reason
    decisions = ("goodput", str(exploit), "exploit")
    before = service.metrics.steps.value(DECISIONS, decisions)
    ran = RanStep(f"{table.table_id}.3", ctx, exploit, exploited=True)
    assert service.table_step([ran], [outcome(ran.decision_id, exploit, size)], None).skipped == 0
    assert service.metrics.steps.value(DECISIONS, decisions) == before + 1  # as exploiting
    # A table whose entries do not explore has no exploit γ to run.
    static = DecisionService("static", {"gamma": 2})
    fixed = static.table_step([], [], context(0, 4, 2)).table
    assert fixed is not None and not fixed.exploit_gammas
    ran = RanStep(f"{fixed.table_id}.1", context(0, 4, 2), 2, exploited=True)
    refused = static.table_step([ran], [], None)
    assert refused.malformed == 1 and "has no exploit γ" in refused.skipped_reason


def test_a_batch_near_the_tables_edge_asks_for_the_next_table() -> None:
    """A batch that drifts leaves its table: the next table is asked for while the held
    one still answers, so the step that leaves it does not wait a round trip."""
    table = GammaTable(
        table_id="t",
        policy_name="p",
        policy_version="v",
        first_batch_size=10,
        gammas=(2,) * 9,  # 10..18
        exploring=(False,) * 9,
        speculation_off=False,
        step_index=0,
        valid_steps=64,
        valid_ms=1000.0,
    )
    cache = TableCache()
    cache.install(table, 1)
    assert due_sizes(cache, range(10, 19)) == [10, 11, 17, 18]
    # A table that starts at batch size 1 has no lower edge to leave.
    cache.install(dataclasses.replace(table, first_batch_size=1), 2)
    assert due_sizes(cache, range(1, 10)) == [8, 9]


def due_sizes(cache: TableCache, sizes: range) -> list[int]:
    """The batch sizes whose next step asks for a new table (none served, none aged)."""
    return [b for b in sizes if refresh_due(cache.held, b, False, 0.0, 32, 1e9)]


def test_over_grpc_steps_come_from_tables_and_every_one_reaches_the_sidecar(
    make_server: Any,
) -> None:
    server = make_server("--policy", "goodput", "--params", '{"seed": 3}')
    client = NightjarClient(
        ClientConfig(target=server.target, engine_id="e0", deadline_s=0.5, connect_timeout_s=10)
    )
    previous, steps = None, 120
    try:
        for step in range(steps):
            ctx = context(step, 10 + step % 7, previous)
            decision = client.take(ctx)
            assert decision.source == "sidecar" and decision.decision_id
            client.report(outcome(decision.decision_id, decision.gamma, ctx.batch_size))
            previous = decision.gamma
            client.ask_ahead(NextStep(ctx, previous))
            time.sleep(0.002)  # "the step runs": the refresh arrives meanwhile
        assert client.stats.tables < steps / 2
    finally:
        client.close()  # sends the last batch and waits for it to be applied
    assert server.state()["reports"] == steps
    scraped = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5)
    committed = f'nightjar_table_steps_total{{result="committed"}} {float(steps)}'
    assert committed in scraped.read().decode()


def test_outcomes_go_to_the_sidecar_in_batches_between_tables(make_server: Any) -> None:
    """The sidecar learns from a batch of REPORT_BATCH_OUTCOMES outcomes without being
    asked for a table: a step the held table cannot answer then waits for a few outcomes
    to be learned from, not for every one since the last table."""
    server = make_server("--policy", "static", "--params", '{"gamma": 2}')
    client = NightjarClient(
        ClientConfig(target=server.target, engine_id="e0", deadline_s=0.5, connect_timeout_s=10)
    )

    def run_steps(first: int, count: int) -> None:
        for step in range(first, first + count):
            ctx = context(step, 10, 2 if step else None)
            decision = client.take(ctx)
            assert decision.source == "sidecar"
            client.report(outcome(decision.decision_id, decision.gamma, ctx.batch_size))
            client.ask_ahead(NextStep(ctx, decision.gamma))

    def applied_after(wanted: int, wait_s: float = 2.0) -> int:
        deadline = time.monotonic() + wait_s
        while server.state()["reports"] < wanted and time.monotonic() < deadline:
            time.sleep(0.01)
        return int(server.state()["reports"])

    try:
        run_steps(0, REPORT_BATCH_OUTCOMES - 1)
        # A batch short of full waits (looked at within the table's refresh period).
        assert applied_after(1, wait_s=TABLE_REFRESH_MS / 4000) == 0
        run_steps(REPORT_BATCH_OUTCOMES - 1, 1)
        assert applied_after(REPORT_BATCH_OUTCOMES) == REPORT_BATCH_OUTCOMES
        assert client.stats.tables == 1  # sent by themselves: no table was due
    finally:
        client.close()


def test_over_grpc_an_empty_request_is_invalid_and_a_context_gets_a_table(
    make_server: Any,
) -> None:
    server = make_server()
    with server.engine() as engine:
        with pytest.raises(StepRejected) as caught:
            engine.send(policy_pb2.StepRequest())
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "needs an outcome, a context or both" in caught.value.message
        reply = engine.send(policy_pb2.StepRequest(context=wire.context_to_pb(context(0, 3))))
    assert reply.HasField("table") and wire.table_from_pb(reply.table).covers(3)


def test_a_swap_voids_the_held_table_at_once(make_server: Any) -> None:
    server = make_server("--policy", "static", "--params", '{"gamma": 2}')
    client = NightjarClient(
        ClientConfig(target=server.target, engine_id="e0", deadline_s=0.5, connect_timeout_s=10)
    )
    try:
        assert client.take(context(0, 4)).gamma == 2
        client.ask_ahead(NextStep(context(1, 4, 2)), always=True)
        deadline = time.monotonic() + 5
        while not client.stats.policy_notices and time.monotonic() < deadline:
            time.sleep(0.01)
        notices = client.stats.policy_notices
        server.admin.SwapPolicy(
            admin_pb2.SwapPolicyRequest(name="off"), metadata=server.auth, timeout=5
        )
        while client.stats.policy_notices == notices and time.monotonic() < deadline:
            time.sleep(0.01)
        # The table of `static` would still be valid for 63 steps and a second.
        decision = client.take(context(1, 4, 2))
        assert decision.gamma == 0 and decision.source == "sidecar"
        assert decision.policy_name == "off"
    finally:
        client.close()


def test_a_swap_while_the_engine_waits_on_a_miss_sends_nothing_to_supersede_it(
    make_server: Any,
) -> None:
    """The notice of a swap reaching the client while its engine waits on a miss: the
    miss's reply comes after the notice on the stream (the new policy decides it), so the
    client asks for no other table; one sent would supersede the miss (ABORTED) and the
    waiting engine would fall back (seen under a loaded host's test run)."""
    server = make_server("--policy", "static", "--params", '{"gamma": 2}')
    client = NightjarClient(
        ClientConfig(target=server.target, engine_id="e0", deadline_s=0.5, connect_timeout_s=10)
    )
    try:
        assert client.take(context(0, 4)).gamma == 2
        deadline = time.monotonic() + 5
        while not client.stats.policy_notices and time.monotonic() < deadline:
            time.sleep(0.01)
        client.ask_ahead(NextStep(context(1, 4, 2)))  # the step the engine runs next
        time.sleep(0.2)  # any refresh that asked for already sent
        asked = client.stats.refresh_requests + client.stats.miss_requests
        client._miss_request = PendingReply()  # the engine waiting on a miss's reply
        client._on_policy_notice("another-version")
        time.sleep(0.3)  # the sender thread would have sent a refresh by now
        assert client.stats.refresh_requests + client.stats.miss_requests == asked
        assert client._tables.held is None  # the old policy's table is still dropped
    finally:
        client._miss_request = None
        client.close()


def test_a_table_asked_for_at_idle_outlasts_the_gap(make_server: Any) -> None:
    """The plugin asks for a table as the engine goes idle (``ask_ahead``): a new one, whose
    time starts at its first step, so the step after a gap longer than a table's valid_ms
    (1 s) is answered from it; the held table, used before the gap, would have expired."""
    server = make_server("--policy", "static", "--params", '{"gamma": 2}')
    client = NightjarClient(
        ClientConfig(target=server.target, engine_id="e0", deadline_s=0.5, connect_timeout_s=10)
    )
    try:
        assert client.take(context(0, 4)).source == "sidecar"  # a miss: no table yet
        client.ask_ahead(NextStep(context(1, 4, 2)), always=True)  # the engine idles
        deadline = time.monotonic() + 5
        while client.stats.tables < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(1.2)
        assert client.take(context(1, 4, 2)).source == "sidecar"
        assert dict(client.stats.table_misses) == {"no_table": 1}
    finally:
        client.close()


def test_a_table_that_ages_during_a_long_step_is_refreshed_meanwhile(make_server: Any) -> None:
    """A step longer than a table's valid_ms (1 s; seconds of prefill on a CPU): the
    client's sender thread asks for a new table while the engine is in the step, so the
    next step is answered from a table instead of waiting a round trip."""
    server = make_server("--policy", "static", "--params", '{"gamma": 2}')
    client = NightjarClient(
        ClientConfig(target=server.target, engine_id="e0", deadline_s=0.5, connect_timeout_s=10)
    )
    try:
        ctx = context(0, 4)
        assert client.take(ctx).source == "sidecar"  # a miss: no table yet
        client.take(context(1, 4))
        client.ask_ahead(NextStep(context(1, 4), 2))  # not due: the table is fresh
        time.sleep(1.3)  # the step
        assert client.take(context(2, 4, 2)).source == "sidecar"
        assert dict(client.stats.table_misses) == {"no_table": 1}
        assert client.stats.tables == 2
    finally:
        client.close()
