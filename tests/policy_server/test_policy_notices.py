"""StepStream policy notices (nightjar.v1.4): a stream that asks is told of every policy
activation, in order with its replies; a stream that does not ask (a client older than
v1.4) sees exactly the replies it asked for. Run on a real DecisionService with an
in-memory request stream, so that "the swap happened between two requests" is exact."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from nightjar_proto.v1 import policy_pb2

from nightjar_common import wire
from nightjar_common.types import StepContext
from policy_server.grpc_server import PolicyServicer
from policy_server.service import DecisionService


def request(seq: int, step: int, notices: bool) -> policy_pb2.StepRequest:
    ctx = StepContext(
        engine_id="e", batch_size=4, step_index=step, free_kv_blocks=500, total_kv_blocks=1000
    )
    msg = policy_pb2.StepRequest(seq=seq, policy_notices=notices)
    msg.context.CopyFrom(wire.context_to_pb(ctx))
    return msg


def run_with_a_swap(
    service: DecisionService, notices: bool
) -> tuple[list[policy_pb2.StepReply], str]:
    """Two requests; between them an admin thread swaps to `off`. Replies and the version
    the swap activated."""
    swapped: list[str] = []

    async def run() -> list[policy_pb2.StepReply]:
        first_answered = asyncio.Event()

        async def sent() -> AsyncIterator[policy_pb2.StepRequest]:
            yield request(1, 0, notices)
            await first_answered.wait()
            # Swap from another thread, as the admin API does; the notice it queues runs
            # on the loop before the next request is read.
            thread = threading.Thread(
                target=lambda: swapped.append(service.swap("off", None, False).version)
            )
            thread.start()
            thread.join()
            await asyncio.sleep(0.05)
            yield request(2, 1, False)

        replies = []
        async for reply in PolicyServicer(service).StepStream(sent(), None):
            replies.append(reply)
            if reply.seq == 1:
                first_answered.set()
        return replies

    return asyncio.run(run()), swapped[0]


def test_a_stream_that_asks_is_told_of_each_activation_in_order() -> None:
    service = DecisionService("static", {"gamma": 2})
    before = service.active.version
    replies, after = run_with_a_swap(service, notices=True)
    assert before != after
    # Its own answer, the confirmation (the version that decided it), the swap's notice,
    # then the next answer, decided by the new version.
    assert [(r.seq, r.policy_version) for r in replies] == [
        (1, ""),
        (0, before),
        (0, after),
        (2, ""),
    ]
    assert [r.decision.gamma for r in replies if r.seq] == [2, 0]
    assert [r.decision.policy_version for r in replies if r.seq] == [before, after]
    assert not any(r.HasField("decision") or r.HasField("error") for r in replies if not r.seq)


def test_a_stream_that_does_not_ask_gets_only_its_replies() -> None:
    service = DecisionService("static", {"gamma": 2})
    replies, _ = run_with_a_swap(service, notices=False)
    assert [r.seq for r in replies] == [1, 2]
    assert [r.decision.gamma for r in replies] == [2, 0]
