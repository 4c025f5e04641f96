"""The machine a benchmark runs on, and the server processes it starts there.

Shared by the benchmarks (so that none imports another for a helper): how a report names
the machine, a free loopback port, and starting and stopping a gRPC server process. Only
the standard library at import: `make bench-memory-gpu` runs where grpcio may be missing.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


def cpu() -> str:
    """The CPU's model name and core count, e.g. "AMD EPYC, 2 cores"."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    name = next(
        (ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")),
        platform.processor() or "unknown CPU",
    )
    return f"{name}, {os.cpu_count()} cores"


def machine() -> str:
    """The machine as a report states it: CPU, cores, Python and grpcio versions."""
    import grpc

    return f"{cpu()}, Python {platform.python_version()}, grpcio {grpc.__version__}"


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop(process: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds."""
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextmanager
def grpc_server(module_args: Sequence[str], target: str, timeout: float = 20) -> Iterator[str]:
    """``python -m MODULE ARGS…`` (its stderr discarded) once it answers at ``target``;
    yields the target and stops the process after."""
    import grpc

    process = subprocess.Popen([sys.executable, "-m", *module_args], stderr=subprocess.DEVNULL)
    try:
        with grpc.insecure_channel(target) as channel:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        yield target
    finally:
        stop(process, timeout=15)
