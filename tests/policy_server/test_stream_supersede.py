"""A sidecar that fell behind answers each engine's newest context, not its backlog.

An engine sends its next context only after it stopped waiting for the previous one, so
when contexts of one engine queue up on its stream the older ones can no longer be used.
StepStream applies them (outcome, ran decision) and answers them ABORTED; only the newest
is decided. The handler runs here on a real DecisionService with an in-memory request
stream, which makes "already queued" deterministic (over a socket it depends on timing).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import grpc
from nightjar_proto.v1 import policy_pb2

from nightjar_common import wire
from nightjar_common.types import Decision, StepContext, StepOutcome
from policy_server.grpc_server import PolicyServicer
from policy_server.service import DecisionService


def context(engine_id: str, step: int, batch: int, **extra: object) -> StepContext:
    return StepContext(
        engine_id=engine_id,
        learner_key="tiny@cpu",
        batch_size=batch,
        step_index=step,
        free_kv_blocks=500,
        total_kv_blocks=1000,
        **extra,  # type: ignore[arg-type]
    )


def outcome(decision: Decision, engine_id: str) -> StepOutcome:
    return StepOutcome(
        decision_id=decision.decision_id,
        engine_id=engine_id,
        gamma=decision.gamma,
        step_seconds=0.02,
        generated_tokens=4,
        drafted_tokens=4 * decision.gamma,
        accepted_tokens=decision.gamma,
    )


def request(seq: int, ctx: StepContext | None, report: StepOutcome | None = None) -> object:
    msg = policy_pb2.StepRequest(seq=seq)
    if ctx is not None:
        msg.context.CopyFrom(wire.context_to_pb(ctx))
    if report is not None:
        msg.outcome.CopyFrom(wire.outcome_to_pb(report))
    return msg


def stream(service: DecisionService, requests: list[object]) -> list[policy_pb2.StepReply]:
    """Every request already sent when the handler starts; its replies, in order."""

    async def sent() -> AsyncIterator[object]:
        for msg in requests:
            yield msg

    async def run() -> list[policy_pb2.StepReply]:
        handler = PolicyServicer(service).StepStream(sent(), None)
        return [reply async for reply in handler]

    return asyncio.run(run())


def counter(service: DecisionService, name: str, **labels: str) -> float:
    value = service.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_queued_contexts_of_an_engine_are_applied_and_only_the_newest_is_decided() -> None:
    service = DecisionService("nightjar", {"seed": 3})
    ran = service.decide(context("e0", 0, 4))
    # A prefetch for step 1 covering batch 3..5: tentative until the engine names one.
    ahead = service.step(None, context("e0", 1, 4, candidate_batch_sizes=(3, 5)))
    assert ahead is not None and ahead.tentative
    (ran_ahead,) = [c for c in ahead.candidates if c.batch_size == 5]
    before = service.state_view()

    replies = stream(
        service,
        [
            # Stale: the engine ran the batch-5 candidate, reported step 0, then gave up on it.
            request(
                1, context("e0", 2, 5, ran_decision_id=ran_ahead.decision_id), outcome(ran, "e0")
            ),
            request(2, context("e1", 0, 2)),  # another engine on the same stream: not stale
            request(3, context("e0", 2, 6)),  # what e0 waits for now
        ],
    )

    assert [r.seq for r in replies] == [1, 2, 3]
    stale, other, newest = replies
    assert not stale.HasField("decision")
    assert stale.error.code == grpc.StatusCode.ABORTED.value[0]
    assert "superseded" in stale.error.message
    assert other.decision.batch_size == 2 and newest.decision.batch_size == 6
    after = service.state_view()
    # The stale request lost nothing: its outcome was learned, its ran decision committed.
    assert after.reports_total == before.reports_total + 1
    assert counter(service, "nightjar_tentative_decisions_total", result="committed") == 1
    # Decided: the committed candidate and the two live contexts, not the stale one.
    assert after.decisions_total == before.decisions_total + 3
    assert counter(service, "nightjar_superseded_contexts_total") == 1


def test_a_bad_stale_context_still_gets_its_own_error_and_changes_nothing() -> None:
    service = DecisionService("nightjar", {"seed": 3})
    ran = service.decide(context("e0", 0, 4))
    bad = dataclasses.replace(context("e0", 1, 4), batch_size=-1)
    before = service.state_view()

    stale, newest = stream(
        service, [request(1, bad, outcome(ran, "e0")), request(2, context("e0", 1, 4))]
    )

    assert stale.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "batch_size" in stale.error.message
    assert newest.HasField("decision")
    after = service.state_view()
    assert after.reports_total == before.reports_total  # all-or-nothing: not applied
    assert counter(service, "nightjar_superseded_contexts_total") == 0


def test_an_engine_that_waits_for_each_reply_is_never_superseded() -> None:
    """The ordinary case: one context at a time (an outcome-only request between)."""
    service = DecisionService("nightjar", {"seed": 3})
    first = service.decide(context("e0", 0, 4))
    replies = stream(
        service, [request(1, None, outcome(first, "e0")), request(2, context("e0", 1, 4))]
    )
    assert not replies[0].HasField("error") and replies[1].HasField("decision")
    assert counter(service, "nightjar_superseded_contexts_total") == 0


def test_the_stream_reads_a_bounded_way_ahead_of_its_answers() -> None:
    """Read-ahead stops at MAX_READ_AHEAD, so a client sending faster than the sidecar
    answers meets gRPC's flow control instead of growing the sidecar's memory."""
    from policy_server.grpc_server import _StreamInbox

    pulled = 0

    async def sent() -> AsyncIterator[policy_pb2.StepRequest]:
        nonlocal pulled
        for seq in range(100):
            pulled += 1
            yield policy_pb2.StepRequest(seq=seq)

    async def run() -> list[int]:
        inbox = _StreamInbox(sent())
        for _ in range(10):  # the reader runs as far as it may
            await asyncio.sleep(0)
        assert pulled == _StreamInbox.MAX_READ_AHEAD
        seqs = []
        while (request := await inbox.next()) is not None:
            seqs.append(request.seq)
            assert pulled - len(seqs) <= _StreamInbox.MAX_READ_AHEAD
        inbox.close()
        return seqs

    assert asyncio.run(run()) == list(range(100))
