"""The fuzzed servers as child processes: started, watched for death, restarted."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


@dataclasses.dataclass
class ServerProcess:
    """One server process listening on a Unix socket; ``args`` follow ``python -m``."""

    name: str
    args: list[str]
    socket: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    channel: grpc.Channel | None = None
    starts: int = 0

    @property
    def target(self) -> str:
        return f"unix:{self.socket}"

    def start(self, timeout: float = 120.0) -> grpc.Channel:
        self.spawn()
        return self.wait_ready(timeout)

    def spawn(self) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", *self.args], stdout=log, stderr=subprocess.STDOUT
            )
        self.starts += 1

    def wait_ready(self, timeout: float = 120.0) -> grpc.Channel:
        """Wait until its health service says SERVING (vLLM's import takes a while)."""
        assert self.proc is not None
        self.channel = grpc.insecure_channel(self.target)
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited at start:\n{self.log_tail()}")
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return self.channel
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not become healthy:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""
