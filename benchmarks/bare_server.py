"""The stock-gRPC baseline of `make bench-load`: the sidecar's wire contract, deciding nothing.

`python -m benchmarks.bare_server --uds PATH` serves `nightjar.v1.PolicyService/StepStream`
(and `AdminService/GetState`, for the load test's counters) on a `grpc.aio` server, as the
sidecar does, and answers every step with γ = 1 and a fresh decision id: no policy, no
validation, no bookkeeping, no metrics. The load test drives it with the same engine
processes, rate and deadline as the real sidecar, so the difference between the two runs is
what the sidecar adds, and what the bare run misses is the host's and Python gRPC's share.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from nightjar_proto.v1 import admin_pb2, admin_pb2_grpc, policy_pb2, policy_pb2_grpc

from nightjar_common import uds

NAME = "bare"


class BarePolicyService(policy_pb2_grpc.PolicyServiceServicer):  # type: ignore[misc]
    """γ = 1 for every context; outcomes are read and dropped."""

    def __init__(self) -> None:
        self.decisions = 0

    async def StepStream(
        self, request_iterator: AsyncIterator[policy_pb2.StepRequest], context: Any
    ) -> AsyncIterator[policy_pb2.StepReply]:
        async for request in request_iterator:
            if not request.HasField("context"):
                yield policy_pb2.StepReply(seq=request.seq)
                continue
            self.decisions += 1
            decision = policy_pb2.Decision(
                gamma=1,
                decision_id=str(self.decisions),
                policy_name=NAME,
                batch_size=request.context.batch_size,
            )
            yield policy_pb2.StepReply(seq=request.seq, decision=decision)


class BareAdminService(admin_pb2_grpc.AdminServiceServicer):  # type: ignore[misc]
    def __init__(self, policy: BarePolicyService) -> None:
        self.policy = policy

    async def GetState(self, request: admin_pb2.GetStateRequest, context: Any) -> Any:
        return admin_pb2.GetStateResponse(policy_name=NAME, decisions_total=self.policy.decisions)


async def serve(uds_path: str) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    policy = BarePolicyService()
    policy_pb2_grpc.add_PolicyServiceServicer_to_server(policy, server)
    admin_pb2_grpc.add_AdminServiceServicer_to_server(BareAdminService(policy), server)
    uds.claim(uds_path)
    uds.bind(server, uds_path)
    await server.start()
    logging.getLogger(__name__).info("bare stream server on unix:%s", uds_path)
    await server.wait_for_termination()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench-bare", description=__doc__.splitlines()[0])
    parser.add_argument("--uds", required=True, help="Unix socket path to listen on")
    args, _ = parser.parse_known_args(argv)  # the sidecar's other options do not apply
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    asyncio.run(serve(args.uds))


if __name__ == "__main__":
    main()
