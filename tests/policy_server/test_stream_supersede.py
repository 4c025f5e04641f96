"""A sidecar that fell behind answers each engine's newest context, not its backlog.

An engine sends its next context only after it stopped waiting for the previous one, so
when contexts of one engine queue up on its stream the older ones can no longer be used.
StepStream applies their report batches (ran steps, outcomes) and answers them ABORTED;
only the newest is decided a table. The handler runs here on a real DecisionService with
an in-memory request stream, which makes "already queued" deterministic (over a socket it
depends on timing).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import grpc
from nightjar_proto.v1 import policy_pb2

from nightjar_common import wire
from nightjar_common.types import GammaTable, RanStep, StepContext, StepOutcome
from policy_server.grpc_server import PolicyServicer, Received, received
from policy_server.metrics import TABLE_STEPS
from policy_server.service import DecisionService


def context(engine_id: str, step: int, batch: int) -> StepContext:
    return StepContext(
        engine_id=engine_id,
        learner_key="tiny@cpu",
        batch_size=batch,
        step_index=step,
        free_kv_blocks=500,
        total_kv_blocks=1000,
    )


def table_for(service: DecisionService, ctx: StepContext) -> GammaTable:
    table = service.table_step([], [], ctx).table
    assert table is not None
    return table


def ran(table: GammaTable, number: int, ctx: StepContext) -> RanStep:
    """Step ``number`` the engine ran from ``table`` at ``ctx``'s batch size."""
    gamma = table.gammas[ctx.batch_size - table.first_batch_size]
    return RanStep(f"{table.table_id}.{number}", ctx, gamma)


def outcome(step: RanStep) -> StepOutcome:
    return StepOutcome(
        decision_id=step.decision_id,
        engine_id=step.context.engine_id,
        gamma=step.gamma,
        step_seconds=0.02,
        generated_tokens=4,
        drafted_tokens=4 * step.gamma,
        accepted_tokens=step.gamma,
    )


def request(
    seq: int,
    ctx: StepContext | None,
    ran_steps: tuple[RanStep, ...] = (),
    outcomes: tuple[StepOutcome, ...] = (),
) -> policy_pb2.StepRequest:
    msg = policy_pb2.StepRequest(
        seq=seq,
        ran_steps=[wire.ran_step_to_pb(step) for step in ran_steps],
        outcomes=[wire.outcome_to_pb(o) for o in outcomes],
    )
    if ctx is not None:
        msg.context.CopyFrom(wire.context_to_pb(ctx))
    return msg


def stream(
    service: DecisionService, requests: list[policy_pb2.StepRequest]
) -> list[policy_pb2.StepReply]:
    """Every request already sent when the handler starts; its replies, in order, after
    the policy notice every stream opens with."""

    async def sent() -> AsyncIterator[Received]:
        for msg in requests:
            yield received(msg)

    async def run() -> list[policy_pb2.StepReply]:
        handler = PolicyServicer(service).StepStream(sent(), None)
        return [reply async for reply in handler]

    notice, *replies = asyncio.run(run())
    assert (notice.seq, notice.policy_version) == (0, service.active.version)
    return replies


def counter(service: DecisionService, name: str, **labels: str) -> float:
    value = service.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def tables_issued(service: DecisionService) -> float:
    return float(service.metrics.tables._value.get())


def committed(service: DecisionService) -> float:
    return float(service.metrics.steps.value(TABLE_STEPS, ("committed",)))


def test_queued_contexts_of_an_engine_are_applied_and_only_the_newest_is_decided() -> None:
    service = DecisionService("nightjar", {"seed": 3})
    step0, step1 = context("e0", 0, 4), context("e0", 1, 5)
    table = table_for(service, step0)
    assert table.first_batch_size <= 5 < table.first_batch_size + len(table.gammas)
    first, second = ran(table, 1, step0), ran(table, 2, step1)
    before, tables_before = service.state_view(), tables_issued(service)

    replies = stream(
        service,
        [
            # Stale: the engine ran two steps from its table, reports them (the first with
            # its outcome) and asks for step 2, then gave up waiting for the answer.
            request(1, context("e0", 2, 5), (first, second), (outcome(first),)),
            request(2, context("e1", 0, 2)),  # another engine on the same stream: not stale
            request(3, context("e0", 2, 6)),  # what e0 waits for now
        ],
    )

    assert [r.seq for r in replies] == [1, 2, 3]
    stale, other, newest = replies
    assert not stale.HasField("table")
    assert stale.error.code == grpc.StatusCode.ABORTED.value[0]
    assert "superseded" in stale.error.message
    assert (
        other.table.first_batch_size <= 2 < other.table.first_batch_size + len(other.table.gammas)
    )
    assert (newest.table.step_index, other.table.step_index) == (2, 0)
    after = service.state_view()
    # The stale request lost nothing: its ran steps were committed, its outcome learned.
    assert committed(service) == 2
    assert after.decisions_total == before.decisions_total + 2
    assert after.reports_total == before.reports_total + 1
    # Tables: for the two live contexts, not the stale one.
    assert tables_issued(service) == tables_before + 2
    assert counter(service, "nightjar_superseded_contexts_total") == 1
    # The second step, still pending, takes its outcome.
    assert service.table_step([], [outcome(second)], None).skipped == 0
    assert service.state_view().reports_total == before.reports_total + 2


def test_a_bad_stale_context_still_gets_its_own_error_and_changes_nothing() -> None:
    service = DecisionService("nightjar", {"seed": 3})
    step0 = context("e0", 0, 4)
    first = ran(table_for(service, step0), 1, step0)
    bad = dataclasses.replace(context("e0", 1, 4), batch_size=-1)
    before, tables_before = service.state_view(), tables_issued(service)

    stale, newest = stream(
        service, [request(1, bad, (first,), (outcome(first),)), request(2, context("e0", 1, 4))]
    )

    assert stale.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "batch_size" in stale.error.message
    assert newest.HasField("table") and not newest.HasField("error")
    after = service.state_view()
    # All or nothing: neither its step nor its outcome was applied.
    assert after.reports_total == before.reports_total
    assert after.decisions_total == before.decisions_total and committed(service) == 0
    assert tables_issued(service) == tables_before + 1
    assert counter(service, "nightjar_superseded_contexts_total") == 0
    # Sent again, the batch is applied in full.
    assert service.table_step([first], [outcome(first)], None).skipped == 0
    assert service.state_view().reports_total == before.reports_total + 1


def test_an_engine_that_waits_for_each_reply_is_never_superseded() -> None:
    """The ordinary case: one context at a time (a report batch alone between)."""
    service = DecisionService("nightjar", {"seed": 3})
    step0 = context("e0", 0, 4)
    first = ran(table_for(service, step0), 1, step0)
    replies = stream(
        service, [request(1, None, (first,), (outcome(first),)), request(2, context("e0", 1, 4))]
    )
    assert not replies[0].HasField("error") and not replies[0].HasField("table")
    assert replies[0].skipped == 0 and replies[1].HasField("table")
    assert service.state_view().reports_total == 1
    assert counter(service, "nightjar_superseded_contexts_total") == 0


def test_the_stream_reads_a_bounded_way_ahead_of_its_answers() -> None:
    """Read-ahead stops at MAX_READ_AHEAD, so a client sending faster than the sidecar
    answers meets gRPC's flow control instead of growing the sidecar's memory."""
    from policy_server.grpc_server import _PolicyNotice, _StreamInbox

    pulled = 0

    async def sent() -> AsyncIterator[Received]:
        nonlocal pulled
        for seq in range(100):
            pulled += 1
            yield received(policy_pb2.StepRequest(seq=seq))

    async def run() -> list[int]:
        inbox = _StreamInbox(sent())
        for _ in range(10):  # the reader runs as far as it may
            await asyncio.sleep(0)
        assert pulled == _StreamInbox.MAX_READ_AHEAD
        seqs = []
        while (request := await inbox.next()) is not None:
            assert not isinstance(request, _PolicyNotice)  # no notice: not subscribed
            assert request.message is not None
            seqs.append(request.message.seq)
            assert pulled - len(seqs) <= _StreamInbox.MAX_READ_AHEAD
        inbox.close()
        return seqs

    assert asyncio.run(run()) == list(range(100))
