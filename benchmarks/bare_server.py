"""The stock-gRPC baseline of `make bench-load`: the sidecar's wire contract, deciding nothing.

`python -m benchmarks.bare_server --uds PATH` (or `--port N`, on loopback) serves
`nightjar.v1.PolicyService/StepStream` (and `AdminService/GetState`, for the load test's
counters) on a `grpc.aio` server, as the sidecar does, and answers every table request with
a table of γ = 1 shaped as the sidecar's: no policy, no validation, no bookkeeping, no
metrics. The load test drives it with the same engine processes, rate, duration, transport
and deadline as the real sidecar, so the difference between the two runs is what the sidecar
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

from nightjar_common import uds, wire
from nightjar_common.types import BinType, GammaTable
from nightjar_common.validation import Limits
from policy_server.service import DEFAULT_HALF_WIDTH, TableOptions

NAME = "bare"
# The sidecar's default table shape: the sizes either side of the asked one, how long it
# serves.
OPTIONS = TableOptions(DEFAULT_HALF_WIDTH)
MAX_BATCH_SIZE = Limits().max_batch_size


class BarePolicyService(policy_pb2_grpc.PolicyServiceServicer):  # type: ignore[misc]
    """A table of γ = 1 for every table request, as wide and as long-lived as the sidecar's
    (so that an engine's steps leave it as often); reports are read and dropped."""

    def __init__(self) -> None:
        # Table steps reported run, as the sidecar's decisions_total counts them.
        self.decisions = 0
        self.tables = 0

    async def StepStream(
        self, request_iterator: AsyncIterator[policy_pb2.StepRequest], context: Any
    ) -> AsyncIterator[policy_pb2.StepReply]:
        async for request in request_iterator:
            self.decisions += len(request.ran_steps)
            if not request.HasField("context"):
                yield policy_pb2.StepReply(seq=request.seq)
                continue
            self.tables += 1
            yield policy_pb2.StepReply(
                seq=request.seq, table=table_for(request.context, self.tables)
            )


def table_for(ctx: policy_pb2.StepContext, number: int) -> policy_pb2.GammaTable:
    """γ = 1 for the sizes around ``ctx``'s batch, in either speculation state."""
    sizes = OPTIONS.sizes(ctx.batch_size, ctx.num_waiting, MAX_BATCH_SIZE)
    first, width = sizes.start, len(sizes)
    table = GammaTable(
        table_id=str(number),
        policy_name=NAME,
        policy_version=NAME,
        first_batch_size=first,
        gammas=(1,) * width,
        exploring=(False,) * width,
        speculation_off=False,
        step_index=ctx.step_index,
        valid_steps=OPTIONS.valid_steps,
        valid_ms=OPTIONS.valid_ms,
        reason=BinType.FIXED,
        any_speculation_state=True,
    )
    return wire.table_to_pb(table)


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
