"""StepStream policy notices: every stream is told, unasked, the policy version it starts
with (a notice before any reply) and every activation after, in order with its replies, so
that an engine drops a table of a policy no longer active. Run on a real DecisionService
with an in-memory request stream, so that "the swap happened between two requests" is
exact."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from nightjar_proto.v1 import policy_pb2

from nightjar_common import wire
from nightjar_common.types import StepContext
from policy_server.grpc_server import PolicyServicer, Received, received
from policy_server.service import DecisionService


def request(seq: int, step: int) -> policy_pb2.StepRequest:
    ctx = StepContext(
        engine_id="e", batch_size=4, step_index=step, free_kv_blocks=500, total_kv_blocks=1000
    )
    msg = policy_pb2.StepRequest(seq=seq)
    msg.context.CopyFrom(wire.context_to_pb(ctx))
    return msg


def run_with_a_swap(service: DecisionService) -> tuple[list[policy_pb2.StepReply], str]:
    """Two requests; between them an admin thread swaps to `off`. Replies and the version
    the swap activated."""
    swapped: list[str] = []

    async def run() -> list[policy_pb2.StepReply]:
        first_answered = asyncio.Event()

        async def sent() -> AsyncIterator[Received]:
            yield received(request(1, 0))
            await first_answered.wait()
            # Swap from another thread, as the admin API does; the notice it queues runs
            # on the loop before the next request is read.
            thread = threading.Thread(
                target=lambda: swapped.append(service.swap("off", None, False).version)
            )
            thread.start()
            thread.join()
            await asyncio.sleep(0.05)
            yield received(request(2, 1))

        replies = []
        async for reply in PolicyServicer(service).StepStream(sent(), None):
            replies.append(reply)
            if reply.seq == 1:
                first_answered.set()
        return replies

    return asyncio.run(run()), swapped[0]


def run_plain(
    service: DecisionService, *requests: policy_pb2.StepRequest
) -> list[policy_pb2.StepReply]:
    """A stream that sends ``requests`` and half-closes: every reply, in order."""

    async def sent() -> AsyncIterator[Received]:
        for msg in requests:
            yield received(msg)

    async def run() -> list[policy_pb2.StepReply]:
        return [reply async for reply in PolicyServicer(service).StepStream(sent(), None)]

    return asyncio.run(run())


def test_a_stream_is_told_its_starting_version_and_each_activation_in_order() -> None:
    service = DecisionService("static", {"gamma": 2})
    before = service.active.version
    replies, after = run_with_a_swap(service)
    assert before != after
    # The version the stream starts with, before anything else; its own answer, decided
    # by it; the swap's notice; then the next answer, decided by the new version.
    assert [(r.seq, r.policy_version) for r in replies] == [
        (0, before),
        (1, ""),
        (0, after),
        (2, ""),
    ]
    answers = [r for r in replies if r.seq]
    assert [set(r.table.gammas) for r in answers] == [{2}, {0}]
    assert [r.table.policy_version for r in answers] == [before, after]
    # A notice carries the version alone: no table, no error, nothing skipped.
    notices = [r for r in replies if not r.seq]
    assert all(r == policy_pb2.StepReply(policy_version=r.policy_version) for r in notices)


def test_every_stream_opens_with_the_active_version_and_no_other_notice() -> None:
    """Without an activation while it is open, a stream gets one notice, the version active
    when it opened (one that has sent nothing yet too), and then exactly its replies."""
    service = DecisionService("static", {"gamma": 2})
    before = service.active.version
    assert [(r.seq, r.policy_version) for r in run_plain(service)] == [(0, before)]
    first = run_plain(service, request(1, 0), request(2, 1))
    assert [(r.seq, r.policy_version) for r in first] == [(0, before), (1, ""), (2, "")]
    after = service.swap("off", None, False).version
    assert after != before
    # A stream opened after the swap starts with the new version; its table was decided
    # by it.
    second = run_plain(service, request(1, 2))
    assert [(r.seq, r.policy_version) for r in second] == [(0, after), (1, "")]
    assert second[1].table.policy_version == after and set(second[1].table.gammas) == {0}
