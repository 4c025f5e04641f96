"""The sidecar under load in `make bench-load` / `make soak`: its process and its admin RPC.

Starts a real `nightjar-server` (or the bare stub of `benchmarks/bare_server.py`) with a
state directory and an admin token; samples its CPU and resident memory from /proc; and,
for the soak, swaps its policy and takes snapshots through the admin RPC, checking that
each snapshot file reads back and loads into its policy.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
from nightjar_proto.v1 import admin_pb2, admin_pb2_grpc

from benchmarks.host import free_port, stop
from policy_server import snapshot
from policy_server.policies import create_policy, learned_state

# Soak: each swap activates the next of these, then the sidecar's own starting policy
# twice (its defaults); the learned state is kept whenever the new policy reads the active
# one's state schema (nightjar → nightjar, ema → ema, ...), and starts fresh otherwise.
SWAP_PLAN: tuple[tuple[str, dict[str, Any]], ...] = (
    ("nightjar", {"seed": 11}),
    ("nightjar", {"seed": 12}),
    ("ema", {}),
    ("ema", {"ema_alpha": 0.3}),
)


class Sidecar:
    """A running `nightjar-server` and an admin channel to it."""

    def __init__(
        self, process: subprocess.Popen[bytes], target: str, token: str, log_path: Path
    ) -> None:
        self.process = process
        self.target = target
        self.auth = [("authorization", f"Bearer {token}")]
        self.log_path = log_path
        self._channel = grpc.insecure_channel(target)
        self._starting_policy: str | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout: float) -> None:
        """Until the sidecar answers; a sidecar that exits or stays silent is an error that
        shows its log."""
        ready = grpc.channel_ready_future(self._channel)
        give_up = time.monotonic() + timeout
        while self.process.poll() is None and time.monotonic() < give_up:
            try:
                ready.result(timeout=0.2)
                return
            except grpc.FutureTimeoutError:
                continue
        ready.cancel()
        state = (
            f"exited with code {self.process.returncode}"
            if self.process.poll() is not None
            else f"gave no answer in {timeout:.0f} s"
        )
        log_tail = self.log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"nightjar-server {state}; its log:\n{log_tail}")

    def admin(self) -> Any:
        return admin_pb2_grpc.AdminServiceStub(self._channel)

    @property
    def starting_policy(self) -> str:
        if self._starting_policy is None:
            reply = self.admin().GetState(admin_pb2.GetStateRequest(), timeout=10)
            self._starting_policy = str(reply.policy_name)
        return self._starting_policy

    def decisions_total(self) -> int:
        reply = self.admin().GetState(admin_pb2.GetStateRequest(), timeout=10)
        return int(reply.decisions_total)

    def log_problems(self) -> list[str]:
        """ERROR/CRITICAL lines and tracebacks in the sidecar's own log."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return [ln for ln in lines if " ERROR " in ln or " CRITICAL " in ln or "Traceback" in ln]

    def close(self) -> None:
        self._channel.close()


SERVER_MODULES = {"nightjar": "policy_server.cli", "bare": "benchmarks.bare_server"}


@contextmanager
def sidecar(transport: str, workdir: Path, server_kind: str = "nightjar") -> Iterator[Sidecar]:
    """A real `nightjar-server` with a state directory and an admin token (or, for
    ``server_kind`` "bare", the baseline stub in its place)."""
    if server_kind not in SERVER_MODULES or transport not in ("uds", "tcp"):
        raise ValueError(f"no {server_kind!r} server on {transport}")
    state_dir = workdir / "state"
    token = secrets.token_hex(16)
    token_file = workdir / "admin.token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    if transport == "uds":
        listen, target = ["--uds", str(workdir / "nightjar.sock")], f"unix:{workdir}/nightjar.sock"
    else:
        port = free_port()
        listen, target = ["--port", str(port)], f"127.0.0.1:{port}"
    log_path = workdir / "server.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                SERVER_MODULES[server_kind],
                *listen,
                "--state-dir",
                str(state_dir),
                "--admin-token-file",
                str(token_file),
                "--log-level",
                "INFO",
            ],
            stderr=log_file,
            stdout=log_file,
        )
    server = Sidecar(process, target, token, log_path)
    try:
        server.wait_ready(timeout=30)
        yield server
    finally:
        server.close()
        stop(process)


@dataclasses.dataclass(frozen=True)
class ProcSample:
    at_s: float
    cpu_s: float
    rss_bytes: int
    # The machine's 1-minute load average: how busy the cores were, by anything.
    load_average: float


def sample_process(pid: int, at_s: float) -> ProcSample:
    """User + system CPU seconds and resident set size of `pid`, from /proc."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # Fields after the command name (which may hold spaces) start at field 3 (state).
    fields = stat.rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu_s = (int(fields[11]) + int(fields[12])) / ticks
    rss_kib = next(
        int(line.split()[1])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("VmRSS:")
    )
    return ProcSample(at_s, cpu_s, rss_kib * 1024, os.getloadavg()[0])


# -- soak: swaps and snapshots ----------------------------------------------------------------


@dataclasses.dataclass
class AdminEvent:
    at_s: float
    action: str
    ok: bool
    detail: str


def swap_plan(starting_policy: str) -> list[tuple[str, dict[str, Any]]]:
    return [*SWAP_PLAN, (starting_policy, {}), (starting_policy, {})]


def state_schema(name: str) -> str:
    return str(learned_state(create_policy(name, {})).state_schema)


def swap(server: Sidecar, index: int, plan: list[tuple[str, dict[str, Any]]]) -> AdminEvent:
    """The plan's next policy, keeping the learned state when the schemas allow it."""
    name, params = plan[index % len(plan)]
    try:
        active = server.admin().GetState(admin_pb2.GetStateRequest(), timeout=10).policy_name
    except grpc.RpcError as exc:
        return AdminEvent(0.0, f"swap to {name}", False, f"{exc.code().name}: {exc.details()}")
    keep_state = state_schema(active) == state_schema(name)
    request = admin_pb2.SwapPolicyRequest(
        name=name, params_json=json.dumps(params) if params else "", keep_state=keep_state
    )
    label = f"swap to {name} {json.dumps(params)}{' keep-state' if keep_state else ''}"
    try:
        reply = server.admin().SwapPolicy(request, metadata=server.auth, timeout=10)
    except grpc.RpcError as exc:
        return AdminEvent(0.0, label, False, f"{exc.code().name}: {exc.details()}")
    return AdminEvent(0.0, label, True, f"{reply.policy_name} {reply.policy_version}")


def snapshot_and_check(server: Sidecar) -> AdminEvent:
    """Take a snapshot through the admin RPC; read the file back and load it into its policy."""
    try:
        reply = server.admin().Snapshot(
            admin_pb2.SnapshotRequest(), metadata=server.auth, timeout=10
        )
    except grpc.RpcError as exc:
        return AdminEvent(0.0, "snapshot", False, f"{exc.code().name}: {exc.details()}")
    path = Path(reply.path)
    problem = check_snapshot(path)
    if problem:
        return AdminEvent(0.0, "snapshot", False, f"{path.name} unusable: {problem}")
    return AdminEvent(0.0, "snapshot", True, f"{path.stat().st_size} bytes, readable and loadable")


def check_snapshot(path: Path) -> str | None:
    """What is wrong with a snapshot file (None: it parses and its state loads into a fresh
    instance of its policy, as a restore would)."""
    try:
        document = snapshot.read(path)
        spec = document["policy"]
        learned_state(create_policy(spec["name"], spec["params"])).load_state(spec["state"])
    except Exception as exc:  # anything wrong with the file is the finding
        return f"{type(exc).__name__}: {exc}"
    return None
