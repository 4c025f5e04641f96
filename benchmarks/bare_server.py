"""The stock-gRPC baseline of `make bench-load`: the sidecar's wire contract, deciding nothing.

`python -m benchmarks.bare_server --uds PATH` (or `--port N`, on loopback) serves
`nightjar.v1.PolicyService/StepStream` (and `AdminService/GetState`, for the load test's
counters) on a `grpc.aio` server, as the sidecar does, and answers every step with γ = 1
and a fresh decision id: no policy, no validation, no bookkeeping, no metrics. The load
test drives it with the same engine processes, rate, duration, transport, pipelining and
deadline as the real sidecar, so the difference between the two runs is what the sidecar
adds, and what the bare run misses is the host's and Python gRPC's share.
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
    """γ = 1 for every context, and for each of its candidate batch sizes (as the sidecar
    answers a prefetch, so that a pipelined engine's prefetched answer fits its batch as
    often as with the sidecar); outcomes and named runs are read and dropped."""

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
            ctx = request.context
            decision_id = str(self.decisions)
            sizes = [b for b in dict.fromkeys(ctx.candidate_batch_sizes) if b != ctx.batch_size]
            decision = policy_pb2.Decision(
                gamma=1,
                decision_id=decision_id,
                policy_name=NAME,
                batch_size=ctx.batch_size,
                tentative=bool(sizes),
                candidates=[
                    policy_pb2.Decision(
                        gamma=1,
                        decision_id=f"{decision_id}-{b}",
                        policy_name=NAME,
                        batch_size=b,
                        tentative=True,
                    )
                    for b in sizes
                ],
            )
            yield policy_pb2.StepReply(seq=request.seq, decision=decision)


class BareAdminService(admin_pb2_grpc.AdminServiceServicer):  # type: ignore[misc]
    def __init__(self, policy: BarePolicyService) -> None:
        self.policy = policy

    async def GetState(self, request: admin_pb2.GetStateRequest, context: Any) -> Any:
        return admin_pb2.GetStateResponse(policy_name=NAME, decisions_total=self.policy.decisions)


async def serve(uds_path: str | None, port: int | None = None) -> None:
    """Serve on the Unix socket ``uds_path``, or on loopback TCP ``port`` (as the sidecar's
    ``--port`` does by default)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    policy = BarePolicyService()
    policy_pb2_grpc.add_PolicyServiceServicer_to_server(policy, server)
    admin_pb2_grpc.add_AdminServiceServicer_to_server(BareAdminService(policy), server)
    if uds_path is not None:
        uds.claim(uds_path)
        uds.bind(server, uds_path)
        where = f"unix:{uds_path}"
    else:
        where = f"127.0.0.1:{port}"
        server.add_insecure_port(where)
    await server.start()
    logging.getLogger(__name__).info("bare stream server on %s", where)
    await server.wait_for_termination()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench-bare", description=__doc__.splitlines()[0])
    listen = parser.add_mutually_exclusive_group(required=True)
    listen.add_argument("--uds", help="Unix socket path to listen on")
    listen.add_argument("--port", type=int, help="TCP port to listen on, loopback only")
    args, _ = parser.parse_known_args(argv)  # the sidecar's other options do not apply
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    asyncio.run(serve(args.uds, args.port))


if __name__ == "__main__":
    main()
