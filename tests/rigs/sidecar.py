"""A real sidecar process for tests and tools: started on a Unix socket with an admin token,
a state directory and a metrics port, with typed stubs on it."""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from nightjar_proto.v1 import admin_pb2, admin_pb2_grpc, policy_pb2, policy_pb2_grpc

from nightjar_common.sidecar_stream import SyncStream

ADMIN_TOKEN = "s3cret-test-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class ServerProcess:
    """A running sidecar and typed handles on it."""

    workdir: Path
    args: list[str]
    uds: Path
    state_dir: Path
    metrics_port: int
    token_file: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    channel: grpc.Channel | None = None

    @property
    def target(self) -> str:
        return f"unix:{self.uds}"

    def start(self, timeout: float = 15.0) -> ServerProcess:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "policy_server.cli", *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        # Retry the connection every 100-500 ms while the server starts: gRPC's default
        # backoff (1 s, growing) can outlast the start-up wait on a loaded machine.
        self.channel = grpc.insecure_channel(
            self.target,
            options=[
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 500),
            ],
        )
        deadline = time.monotonic() + timeout
        health = health_pb2_grpc.HealthStub(self.channel)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log()}")
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return self
            except grpc.RpcError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server did not become healthy:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._close_channel()

    def terminate(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=15)
        self._close_channel()
        return code

    def _close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    @property
    def policy(self) -> Any:
        return policy_pb2_grpc.PolicyServiceStub(self.channel)

    def engine(self) -> EngineStream:
        """A new stream on this sidecar, used a step at a time."""
        assert self.channel is not None
        return EngineStream(self.channel)

    @property
    def admin(self) -> Any:
        return admin_pb2_grpc.AdminServiceStub(self.channel)

    @property
    def auth(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {ADMIN_TOKEN}")]

    def state(self) -> dict[str, Any]:
        """Everything observable about the learned state (for before/after comparisons)."""
        # With the token: without it, the server answers a summary (issue 28 item 5).
        reply = self.admin.GetState(admin_pb2.GetStateRequest(), metadata=self.auth, timeout=5)
        return {
            "policy": reply.policy_name,
            "version": reply.policy_version,
            "params": json.loads(reply.params_json),
            "state": json.loads(reply.state_json),
            "reports": reply.reports_total,
        }


@dataclasses.dataclass(frozen=True)
class RanDecision:
    """A step an engine ran from the table the sidecar sent for its context."""

    gamma: int
    decision_id: str
    batch_size: int
    table: policy_pb2.GammaTable
    context: policy_pb2.StepContext

    @property
    def exploring(self) -> bool:
        return bool(self.table.exploring[self.batch_size - self.table.first_batch_size])

    @property
    def reason(self) -> str:
        """As the decision log says: the table's reason, else explore or exploit."""
        return self.table.reason or ("explore" if self.exploring else "exploit")

    @property
    def policy_name(self) -> str:
        return str(self.table.policy_name)

    @property
    def policy_version(self) -> str:
        return str(self.table.policy_version)

    @property
    def memory_directive(self) -> policy_pb2.MemoryDirective:
        return self.table.memory_directive


class StepRejected(Exception):
    """The sidecar answered a request with a StepReply.error."""

    def __init__(self, error: policy_pb2.StepError) -> None:
        self.code = next(c for c in grpc.StatusCode if c.value[0] == error.code)
        self.message = str(error.message)
        super().__init__(f"{self.code.name}: {self.message}")


class EngineStream:
    """One engine's StepStream, used a step at a time: :meth:`decide` asks for a table for
    a context and runs its entry (the ran step goes with the next request, as an engine
    reports it), :meth:`report` sends an outcome."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.stream = SyncStream(channel)
        self._ran: list[policy_pb2.RanStep] = []

    def decide(self, ctx: policy_pb2.StepContext) -> RanDecision:
        reply = self.send(policy_pb2.StepRequest(context=ctx, ran_steps=self._take_ran()))
        table = reply.table
        gamma = table.gammas[ctx.batch_size - table.first_batch_size]
        decided = RanDecision(gamma, f"{table.table_id}.1", ctx.batch_size, table, ctx)
        self._ran.append(
            policy_pb2.RanStep(decision_id=decided.decision_id, context=ctx, gamma=gamma)
        )
        return decided

    def report(
        self, *outcomes: policy_pb2.StepOutcome, context: policy_pb2.StepContext | None = None
    ) -> policy_pb2.StepReply:
        """Send the steps run so far and ``outcomes`` (with ``context``: and ask for a table
        for it, as an engine's refresh carries its reports); the reply says what was
        skipped."""
        request = policy_pb2.StepRequest(ran_steps=self._take_ran(), outcomes=outcomes)
        if context is not None:
            request.context.CopyFrom(context)
        return self.send(request)

    def send(self, request: policy_pb2.StepRequest) -> policy_pb2.StepReply:
        reply = self.stream.send(request)
        if reply.HasField("error"):
            raise StepRejected(reply.error)
        return reply

    def _take_ran(self) -> list[policy_pb2.RanStep]:
        ran, self._ran = self._ran, []
        return ran

    def close(self) -> None:
        self.stream.close()

    def __enter__(self) -> EngineStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def server_factory(tmp_path: Path) -> Iterator[Any]:
    """Yields factory(*extra_args, start=True, name="s") -> ServerProcess; every server it
    made is killed when the generator resumes."""
    servers: list[ServerProcess] = []
    # Unix socket paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    sock_dir = Path(tempfile.mkdtemp(prefix="nj-"))

    def factory(*extra: str, start: bool = True, name: str = "s") -> ServerProcess:
        token_file = tmp_path / "admin-token"
        token_file.write_text(ADMIN_TOKEN + "\n")
        uds = sock_dir / f"{name}{len(servers)}.sock"
        state_dir = tmp_path / f"state-{name}"
        metrics_port = free_port()
        args = [
            "--uds",
            str(uds),
            "--metrics-port",
            str(metrics_port),
            "--state-dir",
            str(state_dir),
            "--admin-token-file",
            str(token_file),
            "--log-level",
            "INFO",
            *extra,
        ]
        server = ServerProcess(
            tmp_path, args, uds, state_dir, metrics_port, token_file, tmp_path / f"{name}.log"
        )
        servers.append(server)
        return server.start() if start else server

    yield factory
    for server in servers:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(timeout=10)
        server._close_channel()
    shutil.rmtree(sock_dir, ignore_errors=True)


def random_policy_sidecar(
    make_server: Any, log_dir: Path, gamma_max: int, name: str, seed: int = 1
) -> Any:
    """A sidecar on the `random` policy (every γ in 0…``gamma_max`` comes up) with its
    decision log in ``log_dir`` (``server.decision_log``): what the end-to-end engine
    tests run against to see the sidecar's γ reach the engine."""
    log = log_dir / "decisions.jsonl"
    server = make_server(
        "--policy",
        "random",
        "--params",
        json.dumps({"gamma_max": gamma_max, "seed": seed}),
        "--decision-log",
        str(log),
        name=name,
    )
    server.decision_log = log
    return server


def loop_lag_above(metrics_port: int, bound: str) -> float:
    """Timers of a sidecar's decision loop that ran more than ``bound`` seconds late (a
    bucket bound of nightjar_event_loop_lag_seconds, as written: "0.002")."""
    from benchmarks.host import scrape

    sample = scrape(metrics_port)
    lag = "nightjar_event_loop_lag_seconds"
    return sample(f"{lag}_count", ()) - sample(f"{lag}_bucket", (("le", bound),))


def wait_for_quiet_loop(metrics_port: int, timeout: float = 10.0) -> None:
    """Until no timer of the sidecar's loop ran over 2 ms late for half a second: its
    start-up over (the heap frozen once the listeners are up may hold the loop)."""
    last, deadline = loop_lag_above(metrics_port, "0.002"), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = loop_lag_above(metrics_port, "0.002")
        if now == last:
            return
        last = now
    raise AssertionError("the sidecar's loop kept running late")
