"""The real `nightjar-server` that `make reliability-durable` restarts, starves and reads.

A server process on a Unix socket with a metrics port (admin calls unauthenticated: a
test rig), and typed handles on it: health and admin stubs, an engine's stream (a step
decided and run), a metric's value, a snapshot's status code, its log.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from nightjar_proto.v1 import admin_pb2, admin_pb2_grpc, policy_pb2

from benchmarks import host
from benchmarks.host import free_port, stop
from nightjar_common import wire
from nightjar_common.sidecar_stream import SyncStream
from nightjar_common.types import StepContext


@dataclasses.dataclass
class Server:
    process: subprocess.Popen[bytes]
    channel: grpc.Channel
    metrics_port: int
    log_path: Path
    stream: SyncStream | None = None  # an engine's StepStream, opened by the first step

    @property
    def admin(self) -> Any:
        return admin_pb2_grpc.AdminServiceStub(self.channel)

    def serving(self) -> bool:
        reply = health_pb2_grpc.HealthStub(self.channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def metric(self, name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return host.metric(self.metrics_port, name, labels)

    def decide(self, engine: str, batch_size: int) -> int:
        """A step of ``engine`` at ``batch_size``, as an engine runs it: the table the
        sidecar sends for its context, its entry run and reported as run (so the policy
        commits it and its state grows). The step's γ; RuntimeError when the sidecar
        answered an error or skipped the step."""
        if self.stream is None:
            self.stream = SyncStream(self.channel)
        ctx = wire.context_to_pb(StepContext(engine, batch_size=batch_size))
        table = self._applied(policy_pb2.StepRequest(context=ctx)).table
        gamma = int(table.gammas[batch_size - table.first_batch_size])
        ran = policy_pb2.RanStep(decision_id=f"{table.table_id}.1", context=ctx, gamma=gamma)
        self._applied(policy_pb2.StepRequest(ran_steps=[ran]))
        return gamma

    def _applied(self, request: policy_pb2.StepRequest) -> policy_pb2.StepReply:
        assert self.stream is not None
        reply = self.stream.send(request)
        if reply.HasField("error") or reply.skipped:
            raise RuntimeError(f"step refused: {reply.error.message or reply.skipped_reason}")
        return reply

    def close_stream(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None

    def snapshot_code(self) -> grpc.StatusCode:
        try:
            self.admin.Snapshot(admin_pb2.SnapshotRequest(), timeout=30)
        except grpc.RpcError as exc:
            code: grpc.StatusCode = exc.code()
            return code
        return grpc.StatusCode.OK

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def running_server(
    workdir: Path, args: Sequence[str], preexec: Callable[[], None] | None = None
) -> Iterator[Server]:
    """A `nightjar-server` on a Unix socket (admin calls unauthenticated: a test rig)."""
    sock_dir = Path(tempfile.mkdtemp(prefix="nj-durable-"))  # short: socket path limits
    metrics_port = free_port()
    log_path = workdir / f"server-{len(list(workdir.glob('server-*.log')))}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "policy_server.cli",
                "--uds",
                str(sock_dir / "s.sock"),
                "--metrics-port",
                str(metrics_port),
                *args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec,
        )
    channel = grpc.insecure_channel(f"unix:{sock_dir / 's.sock'}")
    server = Server(process, channel, metrics_port, log_path)
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server exited early:\n{server.log()}")
            try:
                if server.serving():
                    break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.05)
        yield server
    finally:
        server.close_stream()
        channel.close()
        stop(process)
        for leftover in sock_dir.iterdir():
            leftover.unlink()
        sock_dir.rmdir()
