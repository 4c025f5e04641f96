"""Unix sockets of the sidecar and the memory agent: a live server's path is never taken over."""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from memory_agent import service
from memory_agent.agent import MemoryAgent
from nightjar_common import uds
from nightjar_common.client import ClientConfig, NightjarClient
from nightjar_common.uds import SocketPathError
from tests.nightjar_common.test_client import wait_until


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
        capture_output=True,
        text=True,
        timeout=60,
    )


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


def file_mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_sidecar_socket_is_group_writable_0660_by_default(make_server: Any) -> None:
    server = make_server()
    assert file_mode(server.uds) == 0o660
    assert "has mode 0660" in server.log()


def test_uds_mode_is_configurable_and_checked(make_server: Any, tmp_path: Path) -> None:
    server = make_server("--uds-mode", "0600")
    assert file_mode(server.uds) == 0o600
    bad = run_server("--uds", str(tmp_path / "s.sock"), "--uds-mode", "rw-rw----")
    assert bad.returncode == 2 and "uds_mode: socket mode must be octal" in bad.stderr
    locked_out = run_server("--uds", str(tmp_path / "s.sock"), "--uds-mode", "0060")
    assert locked_out.returncode == 2 and "leaves the owner unable" in locked_out.stderr


class WatchedServer:
    """A real gRPC server; records its socket file's mode the moment gRPC created it."""

    def __init__(self) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        self.mode_at_bind: int | None = None

    def add_insecure_port(self, address: str) -> int:
        port: int = self.server.add_insecure_port(address)
        self.mode_at_bind = file_mode(Path(address.removeprefix("unix:")))
        return port


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_socket_is_never_wider_than_its_mode(short_dir: Path, umask: int) -> None:
    """Even under a permissive umask (0: files 0777) the file is born within the mode;
    it ends exactly at the mode whatever the umask, and the umask is restored."""
    watched = WatchedServer()
    previous = os.umask(umask)
    try:
        uds.bind(watched, short_dir / "s.sock", 0o660)
        assert os.umask(umask) == umask
    finally:
        os.umask(previous)
    assert watched.mode_at_bind is not None and watched.mode_at_bind & ~0o660 == 0
    assert file_mode(short_dir / "s.sock") == 0o660
    watched.server.stop(grace=0)


def test_memory_agent_socket_mode(short_dir: Path) -> None:
    from vllm_client_patch.config import PluginConfig, PluginConfigError

    config = PluginConfig.load({"NIGHTJAR_MEMORY_SOCKET_MODE": "0600"})
    assert config.memory_socket_mode == 0o600 and PluginConfig().memory_socket_mode == 0o660
    with pytest.raises(PluginConfigError, match="NIGHTJAR_MEMORY_SOCKET_MODE"):
        PluginConfig.load({"NIGHTJAR_MEMORY_SOCKET_MODE": "999"})
    for name, mode in (("default.sock", None), ("private.sock", 0o600)):
        path = short_dir / name
        server: Any = (
            service.serve(agent(), str(path))
            if mode is None
            else service.serve(agent(), str(path), mode=mode)
        )
        try:
            assert file_mode(path) == (0o660 if mode is None else mode)
            assert healthy(f"unix:{path}")
        finally:
            server.stop(grace=0).wait()


def test_plugin_warns_once_when_it_cannot_connect_and_once_when_it_does(
    make_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server = make_server(start=False)
    stale_socket(server.uds)  # a socket file nobody listens on: connection refused
    caplog.set_level(logging.INFO, logger="nightjar_common.sidecar_connection")
    client = NightjarClient(ClientConfig(target=server.target, engine_id="e"))
    try:
        assert wait_until(lambda: any("cannot connect" in r.message for r in caplog.records))
        time.sleep(1.0)  # more failed attempts: still one warning
        (warning,) = [r for r in caplog.records if "cannot connect" in r.message]
        assert warning.levelno == logging.WARNING
        assert f"the sidecar at {server.target}: [Errno {errno.ECONNREFUSED}]" in warning.message
        assert "local fallback table" in warning.message
        server.start()
        assert client.wait_connected(10)
        assert wait_until(
            lambda: any("connected to the sidecar" in r.message for r in caplog.records)
        )
        (connected,) = [r for r in caplog.records if "connected to the sidecar" in r.message]
        assert connected.levelno == logging.WARNING  # as loud as the warning it ends
    finally:
        client.close()


def test_plugin_names_a_missing_socket(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="nightjar_common.sidecar_connection")
    target = f"unix:{tmp_path}/absent.sock"
    client = NightjarClient(ClientConfig(target=target, engine_id="e"))
    try:
        assert wait_until(lambda: any("cannot connect" in r.message for r in caplog.records))
        (warning,) = [r for r in caplog.records if "cannot connect" in r.message]
        assert f"[Errno {errno.ENOENT}] No such file or directory" in warning.message
        assert "is the sidecar running" in warning.message
    finally:
        client.close()


def test_plugin_logs_a_quiet_first_connection_at_info(
    make_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server = make_server()
    caplog.set_level(logging.INFO, logger="nightjar_common.sidecar_connection")
    client = NightjarClient(ClientConfig(target=server.target, engine_id="e", connect_timeout_s=5))
    try:
        assert client.connected
        assert wait_until(
            lambda: any("connected to the sidecar" in r.message for r in caplog.records)
        )
        assert [r.levelno for r in caplog.records if r.levelno >= logging.WARNING] == []
    finally:
        client.close()


def test_a_tcp_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_server("--port", str(port), "--uds", str(tmp_path / "s.sock"))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "nightjar-server: cannot listen:" in result.stderr
