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
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name, e.g. "AMD EPYC"."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    return next(
        (ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")),
        platform.processor() or "unknown CPU",
    )


def cpu() -> str:
    """The CPU's model name and core count, e.g. "AMD EPYC, 2 cores"."""
    return f"{cpu_model()}, {os.cpu_count()} cores"


Sample = Callable[[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Sample:
    """One read of a server's Prometheus exposition on the loopback ``port``, as
    ``sample(name, labels)``: the first sample named ``name`` whose labels include
    ``labels`` (KeyError when there is none). Samples read together come from one scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:  # loopback
        body = reply.read().decode()
    samples = [s for family in text_string_to_metric_families(body) for s in family.samples]

    def sample(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        for found in samples:
            if found.name == name and set(labels) <= set(found.labels.items()):
                return float(found.value)
        raise KeyError(name)

    return sample


def metric(port: int, name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
    """One sample of a server's exposition on the loopback ``port`` (:func:`scrape`)."""
    return scrape(port)(name, labels)


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
