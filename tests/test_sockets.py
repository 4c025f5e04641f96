"""Unix sockets of the sidecar and the memory agent: a live server's path is never taken over."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from memory_agent import service
from memory_agent.agent import MemoryAgent
from policy_server.uds import SocketPathError


def healthy(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def stale_socket(path: Path) -> None:
    """A socket file nobody listens on, as a SIGKILLed server leaves it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))


def run_server(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "policy_server.cli", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_second_server_on_a_live_socket_refuses_and_the_first_keeps_it(make_server: Any) -> None:
    first = make_server()
    second = run_server("--uds", str(first.uds))
    assert second.returncode == 1
    assert f"another server is listening on {first.uds}" in second.stderr
    assert "Traceback" not in second.stderr
    assert first.uds.is_socket() and healthy(first.target)


def test_a_stale_socket_is_replaced(make_server: Any) -> None:
    server = make_server(start=False)
    stale_socket(server.uds)
    server.start()  # would time out if the stale file blocked it
    assert healthy(server.target)
    assert "removed the stale socket" in server.log()


def test_a_path_that_is_not_a_socket_is_never_removed(tmp_path: Path) -> None:
    path = tmp_path / "precious.txt"
    path.write_text("data")
    result = run_server("--uds", str(path))
    assert result.returncode == 1 and "is not a socket: refusing to replace it" in result.stderr
    assert path.read_text() == "data"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    import shutil
    import tempfile

    # Unix socket paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="nj-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def agent() -> MemoryAgent:
    return MemoryAgent(capacity_blocks=64, block_bytes=4096, draft_bytes=4 * 4096)


def test_memory_agent_socket_is_claimed_the_same_way(short_dir: Path) -> None:
    path = short_dir / "memory.sock"
    first: Any = service.serve(agent(), str(path))
    try:
        with pytest.raises(SocketPathError, match="another server is listening"):
            service.serve(agent(), str(path))
        assert healthy(f"unix:{path}")
    finally:
        first.stop(grace=0).wait()
    stale_socket(path)  # as a killed engine leaves it: the next agent replaces it
    second: Any = service.serve(agent(), str(path))
    try:
        assert healthy(f"unix:{path}")
    finally:
        second.stop(grace=0).wait()
