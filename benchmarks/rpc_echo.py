"""The stock gRPC baseline of `make bench-rpc`: a bare echo server and a plain client.

The server answers every message with its own bytes on a bidirectional stream, on
grpcio's thread-pool server or its asyncio server, so a round trip to it is what
Python gRPC costs with no work behind it. `benchmarks/rpc.py` starts it as a process:

    python -m benchmarks.rpc_echo ADDRESS [--kind aio|sync]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import grpc

from benchmarks.host import grpc_server
from benchmarks.rpc_report import Measurement, summarise

ECHO_SERVICE = "nightjar.bench.Echo"
ECHO_KINDS = ("sync", "aio")


def _identity(data: bytes) -> bytes:
    return data


def serve_echo(address: str, kind: str) -> None:
    """A bare echo (bytes in, the same bytes out, on a bidirectional stream), on
    grpcio's thread-pool server ("sync") or its asyncio server ("aio"): what Python gRPC
    costs with no work behind it. Runs until killed."""
    import asyncio
    from concurrent import futures

    if kind == "sync":

        def stream(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
            yield from requests

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        server.add_generic_rpc_handlers((_echo_handlers(stream),))
        server.add_insecure_port(address)
        server.start()
        server.wait_for_termination()
        return

    async def aio_stream(requests: Any, context: Any) -> Any:
        async for request in requests:
            yield request

    async def run() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((_echo_handlers(aio_stream),))
        server.add_insecure_port(address)
        await server.start()
        await server.wait_for_termination()

    asyncio.run(run())


def _echo_handlers(stream: Any) -> Any:
    return grpc.method_handlers_generic_handler(
        ECHO_SERVICE,
        {"Stream": grpc.stream_stream_rpc_method_handler(stream, _identity, _identity)},
    )


@contextmanager
def echo_server(kind: str) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="nj-echo-") as tmp:
        target = f"unix:{tmp}/echo.sock"
        with grpc_server(["benchmarks.rpc_echo", target, "--kind", kind], target):
            yield target


def measure_echo(kind: str, count: int, payload: bytes) -> Measurement:
    """Round trips of ``payload`` (a StepRequest as the plugin sends it) to a bare echo
    server over a Unix socket, from a plain grpcio client (a stream fed from a queue, read
    in the calling thread)."""
    import queue

    with echo_server(kind) as target, grpc.insecure_channel(target) as channel:
        nanos: list[int] = []
        requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        call: Any = channel.stream_stream(f"/{ECHO_SERVICE}/Stream", _identity, _identity)(
            iter(requests.get, None)
        )
        for i in range(count + 300):
            start = time.perf_counter_ns()
            requests.put(payload)
            next(call)
            if i >= 300:
                nanos.append(time.perf_counter_ns() - start)
        requests.put(None)
    return summarise(f"stock echo, {kind} server, uds stream", nanos)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.rpc_echo", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "address", help="where to listen, e.g. unix:echo.sock (relative to the working directory)"
    )
    parser.add_argument("--kind", choices=ECHO_KINDS, default="aio")
    args = parser.parse_args(argv)
    serve_echo(args.address, args.kind)  # until killed
    return 0


if __name__ == "__main__":
    sys.exit(main())
