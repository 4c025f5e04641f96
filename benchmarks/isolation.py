"""`make bench-isolation`: one engine's heavy work against another engine's decisions.

A real nightjar-server (goodput with per-request records) serves a small engine that asks
for a table at a time (a context of 8 requests, no per-request sections) from a process
of its own, so its round trips measure the sidecar, not this process's GIL. Meanwhile one
case at a time loads the sidecar, each the way issue 54 (finding 4) found it stalling the
others:

* ``contexts``: another engine sending valid 0.85 MB contexts (4,096 requests, 180-character
  ids, 16 recent_accepts each), a table each;
* ``per_request``: another engine running 4,096-request steps from its tables with their
  per-request outcomes (a per-request plan each table);
* ``get_state``, ``snapshot``, ``restore``: whole-state reads, snapshots and restores of
  a state of about 48 MB (per-request records of many engines, restored first).

Then, as a control, each load again on a second sidecar process while the small engine
asks the first: nothing is shared but the host's CPUs, so the control's figures are what
the cores alone cost the small engine, and the difference to the case's own row is what
the sidecar's process adds (its loop, its GIL, its locks).

It prints, and writes as a section of docs/BENCHMARKS.md (``--out``) and as JSON
(``--json``), the small engine's round trips per case:
count, p50, p99, max, and the share past the plugin's 2 ms deadline. The host's other
load moves these figures: run it on a quiet host, and read them with its CPU count.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from nightjar_proto.v1 import admin_pb2, admin_pb2_grpc, policy_pb2

from benchmarks.fuzz.processes import ServerProcess
from benchmarks.host import cpu_model, free_port, metric
from benchmarks.report import write_section
from nightjar_common import wire
from nightjar_common.sidecar_stream import SyncStream
from nightjar_common.types import RequestSignals, StepContext, StepOutcome
from policy_server.config import admin_message_bytes

DEADLINE_S = 0.002
MAX_REQUESTS = 4096
ID_LENGTH = 180
# The restored state's per-request records: engines × MAX_REQUESTS records of ~200 bytes.
STATE_ENGINES = 56
TIMEOUT_S = 120.0
LARGE = [
    ("grpc.max_receive_message_length", admin_message_bytes()),
    ("grpc.max_send_message_length", admin_message_bytes()),
]
CASES = ("baseline", "contexts", "per_request", "get_state", "snapshot", "restore")


def _context(engine: str, step: int, requests: tuple[RequestSignals, ...] = ()) -> Any:
    batch = len(requests) or 8
    ctx = StepContext(
        engine_id=engine,
        step_index=step,
        batch_size=batch,
        max_gamma=4,
        learner_key=f"m@{engine}",
        requests=requests,
    )
    return wire.context_to_pb(ctx)


def _signals(engine: str, recent: int) -> tuple[RequestSignals, ...]:
    return tuple(
        RequestSignals(f"{engine}-{i}-".ljust(ID_LENGTH, "x"), 900, tuple(range(recent)))
        for i in range(MAX_REQUESTS)
    )


# -- the small engine, in a process of its own --------------------------------------------


def probe(target: str, seconds: float) -> list[float]:
    """Round trips of a small engine asking for a table at a time, for ``seconds``."""
    channel = grpc.insecure_channel(target)
    stream = SyncStream(channel, timeout_s=TIMEOUT_S)
    latencies: list[float] = []
    step = 0
    until = time.perf_counter() + seconds
    try:
        while time.perf_counter() < until:
            request = policy_pb2.StepRequest(context=_context("small", step))
            started = time.perf_counter()
            reply = stream.send(request)
            latencies.append(time.perf_counter() - started)
            if reply.HasField("error"):
                raise RuntimeError(reply.error.message)
            step += 1
            time.sleep(0.002)  # an engine's step: it asks between steps, not flat out
    finally:
        stream.close()
        channel.close()
    return latencies


def _run_probe(target: str, seconds: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.isolation",
            "--probe",
            target,
            "--seconds",
            str(seconds),
        ],
        stdout=subprocess.PIPE,
    )


# -- the loads ------------------------------------------------------------------------------


class Loads:
    """Each case's load on the sidecar, run in a thread until ``stop`` is set."""

    def __init__(self, channel: grpc.Channel, large: grpc.Channel, auth: Any, state_dir: Path):
        self.channel = channel
        self.admin = admin_pb2_grpc.AdminServiceStub(large)
        self.auth = auth
        self.state_dir = state_dir
        self.calls = 0

    def contexts(self, stop: threading.Event) -> None:
        stream = SyncStream(self.channel, timeout_s=TIMEOUT_S)
        request = policy_pb2.StepRequest(context=_context("big", 0, _signals("big", 16)))
        try:
            while not stop.is_set():
                stream.send(request)
                self.calls += 1
        finally:
            stream.close()

    def per_request(self, stop: threading.Event) -> None:
        stream = SyncStream(self.channel, timeout_s=TIMEOUT_S)
        signals = _signals("planner", 4)
        ids = tuple(s.request_id for s in signals)
        step = 0
        try:
            while not stop.is_set():
                ctx = _context("planner", step, signals)
                reply = stream.send(policy_pb2.StepRequest(context=ctx))
                table = reply.table
                gamma = table.gammas[MAX_REQUESTS - table.first_batch_size]
                ran = policy_pb2.RanStep(
                    decision_id=f"{table.table_id}.1", context=ctx, gamma=gamma
                )
                accepts = tuple(i % (gamma + 1) for i in range(MAX_REQUESTS))
                outcome = StepOutcome(
                    decision_id=ran.decision_id,
                    engine_id="planner",
                    gamma=gamma,
                    step_seconds=0.05,
                    generated_tokens=MAX_REQUESTS + sum(accepts),
                    drafted_tokens=gamma * MAX_REQUESTS,
                    accepted_tokens=sum(accepts),
                    request_accepts=accepts,
                    request_ids=ids,
                )
                stream.send(
                    policy_pb2.StepRequest(ran_steps=[ran], outcomes=[wire.outcome_to_pb(outcome)])
                )
                self.calls += 1
                step += 1
        finally:
            stream.close()

    def get_state(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.admin.GetState(admin_pb2.GetStateRequest(), metadata=self.auth, timeout=TIMEOUT_S)
            self.calls += 1

    def snapshot(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.admin.Snapshot(admin_pb2.SnapshotRequest(), metadata=self.auth, timeout=TIMEOUT_S)
            self.calls += 1

    def restore(self, stop: threading.Event) -> None:
        document = (self.state_dir / "snapshot.json").read_text()
        while not stop.is_set():
            self.admin.Restore(
                admin_pb2.RestoreRequest(snapshot_json=document),
                metadata=self.auth,
                timeout=TIMEOUT_S,
            )
            self.calls += 1

    def build_state(self) -> int:
        """A state of per-request records of STATE_ENGINES engines, restored and snapshotted;
        its snapshot's size."""
        stream = SyncStream(self.channel, timeout_s=TIMEOUT_S)
        try:
            ctx = _context("seed", 0)
            table = stream.send(policy_pb2.StepRequest(context=ctx)).table
            gamma = table.gammas[8 - table.first_batch_size]
            ran = policy_pb2.RanStep(decision_id=f"{table.table_id}.1", context=ctx, gamma=gamma)
            outcome = StepOutcome(
                decision_id=ran.decision_id,
                engine_id="seed",
                gamma=gamma,
                step_seconds=0.02,
                generated_tokens=8,
                drafted_tokens=8 * gamma,
                accepted_tokens=0,
            )
            reply = stream.send(
                policy_pb2.StepRequest(ran_steps=[ran], outcomes=[wire.outcome_to_pb(outcome)])
            )
            assert not reply.skipped, reply.skipped_reason
        finally:
            stream.close()
        self.admin.Snapshot(admin_pb2.SnapshotRequest(), metadata=self.auth, timeout=TIMEOUT_S)
        document = json.loads((self.state_dir / "snapshot.json").read_text())
        state = document["policy"]["state"]
        seed = state["engines"]["seed"]
        for index in range(STATE_ENGINES):
            engine = f"held{index}"
            records = {
                f"{engine}-{i}-".ljust(ID_LENGTH, "x"): [3.0, 1.0, 1] for i in range(MAX_REQUESTS)
            }
            state["engines"][engine] = {**seed, "requests": records, "observed_steps": 1}
            document["engines"].append(engine)
        text = json.dumps(document)
        self.admin.Restore(
            admin_pb2.RestoreRequest(snapshot_json=text), metadata=self.auth, timeout=TIMEOUT_S
        )
        self.admin.Snapshot(admin_pb2.SnapshotRequest(), metadata=self.auth, timeout=TIMEOUT_S)
        return (self.state_dir / "snapshot.json").stat().st_size


def summary(latencies: list[float], calls: int) -> dict[str, Any]:
    ordered = sorted(latencies)
    count = len(ordered)
    return {
        "round_trips": count,
        "p50_ms": round(1000 * statistics.median(ordered), 3),
        "p99_ms": round(1000 * ordered[min(count - 1, int(0.99 * count))], 3),
        "max_ms": round(1000 * ordered[-1], 3),
        "past_deadline": round(sum(1 for v in ordered if v > DEADLINE_S) / count, 4),
        "load_calls": calls,
    }


class Sidecar:
    """One nightjar-server process of the benchmark and the loads that can run on it."""

    def __init__(self, workdir: Path, name: str):
        workdir.mkdir()
        token = workdir / "token"
        token.write_text(secrets.token_hex(16))
        state_dir = workdir / "state"
        state_dir.mkdir()
        self.metrics_port = free_port()
        self.server = ServerProcess(
            name,
            [
                "policy_server.cli",
                "--uds",
                str(workdir / "s.sock"),
                "--state-dir",
                str(state_dir),
                "--admin-token-file",
                str(token),
                "--policy",
                "goodput",
                "--params",
                json.dumps({"per_request": True}),
                "--log-level",
                "ERROR",
                "--metrics-port",
                str(self.metrics_port),
            ],
            workdir / "s.sock",
            workdir / "server.log",
        )
        channel = self.server.start(timeout=60)
        self.large = grpc.insecure_channel(self.server.target, options=LARGE)
        auth = (("authorization", f"Bearer {token.read_text()}"),)
        self.loads = Loads(channel, self.large, auth, state_dir)

    def full_collections(self) -> tuple[float, float]:
        """The count and summed seconds of the sidecar's full garbage collections so far
        (nightjar_gc_pause_seconds{generation="2"})."""
        full = (("generation", "2"),)
        count = metric(self.metrics_port, "nightjar_gc_pause_seconds_count", full)
        return count, metric(self.metrics_port, "nightjar_gc_pause_seconds_sum", full)

    def close(self) -> None:
        self.large.close()
        self.server.stop()


def measure(probed: Sidecar, loaded: Sidecar, case: str, seconds: float) -> dict[str, Any]:
    """The probed sidecar's small engine while ``case``'s load runs on ``loaded``."""
    loads = loaded.loads
    load: Callable[[threading.Event], None] | None = getattr(loads, case, None)
    loads.calls = 0
    stop = threading.Event()
    worker = threading.Thread(target=load, args=(stop,), daemon=True) if load else None
    if worker is not None:
        worker.start()
        time.sleep(1.0)  # the load under way before the small engine measures
    count, total = probed.full_collections()
    prober = _run_probe(probed.server.target, seconds)
    out, _ = prober.communicate(timeout=seconds + TIMEOUT_S)
    after_count, after_total = probed.full_collections()
    stop.set()
    if worker is not None:
        worker.join(timeout=TIMEOUT_S)
    row = summary(json.loads(out), loads.calls)
    # The probed sidecar's full collections while the small engine measured (each holds
    # the GIL: no engine answered meanwhile).
    row["full_collections"] = int(after_count - count)
    row["full_collection_ms"] = round(1000 * (after_total - total), 1)
    return row


def run(seconds: float, cases: list[str], control: bool = True) -> dict[str, Any]:
    """Each case's load on the small engine's sidecar; with ``control``, each load again on
    a second sidecar process beside it (the same host, nothing of the first shared): what
    the host's cores alone do to the small engine, against which the first is read."""
    workdir = Path(tempfile.mkdtemp(prefix="nightjar-isolation-"))
    sidecars = [Sidecar(workdir / "probed", "isolation")]
    loaded_cases = [case for case in cases if case != "baseline"]
    if control and loaded_cases:
        sidecars.append(Sidecar(workdir / "other", "isolation-control"))
    results: dict[str, Any] = {"host": _host(), "seconds_per_case": seconds, "cases": {}}
    try:
        if {"get_state", "snapshot", "restore"} & set(cases):
            sizes = [sidecar.loads.build_state() for sidecar in sidecars]
            results["state_bytes"] = sizes[0]
        probed = sidecars[0]
        for case in cases:
            results["cases"][case] = measure(probed, probed, case, seconds)
            print(case, results["cases"][case], flush=True)
        for other in sidecars[1:]:
            for case in loaded_cases:
                row = measure(probed, other, case, seconds)
                results["cases"][f"{case}{CONTROL_SUFFIX}"] = row
                print(case, "on another sidecar", row, flush=True)
    finally:
        for sidecar in sidecars:
            sidecar.close()
    return results


# A control case's name: its load on a second sidecar process.
CONTROL_SUFFIX = ", other sidecar"


LOADS = {
    "baseline": "none",
    "contexts": "another engine's 0.85 MB contexts (4,096 requests, 180-character ids, 16 "
    "recent_accepts each), a table each",
    "per_request": "another engine's 4,096-request steps: table (per-request plan), ran step, "
    "per-request outcome",
    "get_state": "GetState of the whole state, back to back",
    "snapshot": "Snapshot, back to back",
    "restore": "Restore of the whole state by snapshot_json, back to back",
}


def load_text(case: str) -> str:
    """What a case's load is, for its row."""
    base = case.removesuffix(CONTROL_SUFFIX)
    text = LOADS.get(base, base)
    if base == case:
        return text
    return f"the same load as `{base}`, on a second sidecar process (the control)"


def _busy(host: dict[str, Any]) -> str:
    """Whether the load average at the start says other work held the host's CPUs."""
    if float(host["loadavg_at_start"][0]) >= 0.5 * host["cpus"]:
        return ": other work was running"
    return ""


def render(results: dict[str, Any]) -> str:
    """The section of docs/BENCHMARKS.md."""
    host = results["host"]
    state = results.get("state_bytes")
    lines = [
        "## Isolation: one engine's heavy work against another's decisions "
        "(`make bench-isolation`)",
        "",
        f"`make bench-isolation` (benchmarks/isolation.py), on a host of {host['cpus']} CPUs "
        f"({host.get('model', 'CPU model not recorded')}; load average "
        f"{', '.join(host['loadavg_at_start'])} at the start{_busy(host)}), "
        f"Python {host['python']}. A real nightjar-server (goodput, per_request "
        "on) serves a small engine in a process of its own that asks for a table at a time "
        "(8 requests, no per-request sections) every 2 ms, for "
        f"{results['seconds_per_case']:g} s per case, while one load runs"
        + (f" (the whole state: a snapshot of {state:,} bytes, restored first)" if state else "")
        + '. Rows ending in "other sidecar" are the control: the same load on a second '
        "sidecar process beside the first, sharing nothing with it but the host's CPUs, "
        "so that what the cores alone cost the small engine reads apart from what the "
        "sidecar's own process does. The small engine's round trips, its deadline 2 ms, "
        "and the full garbage collections its sidecar ran meanwhile "
        '(`nightjar_gc_pause_seconds{generation="2"}`: each holds the GIL):',
        "",
        "| case | load | round trips | p50 ms | p99 ms | max ms | past 2 ms | load calls "
        "| full collections (ms in all) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case, row in results["cases"].items():
        collections = (
            f"{row['full_collections']:,} ({row['full_collection_ms']:,.1f})"
            if "full_collections" in row
            else "not measured"
        )
        lines.append(
            f"| {case} | {load_text(case)} | {row['round_trips']:,} | {row['p50_ms']:.2f} "
            f"| {row['p99_ms']:.2f} | {row['max_ms']:.2f} | {100 * row['past_deadline']:.1f} % "
            f"| {row['load_calls']:,} | {collections} |"
        )
    return "\n".join(lines) + "\n"


def _host() -> dict[str, Any]:
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    return {
        "cpus": os.cpu_count(),
        "model": cpu_model(),
        "loadavg_at_start": load,
        "python": sys.version.split()[0],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="per case")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--out", type=Path, default=None, help="docs/BENCHMARKS.md to write")
    parser.add_argument("--json", type=Path, default=None, help="the figures as JSON")
    parser.add_argument(
        "--no-control",
        action="store_true",
        help="skip the control cases (each load on a second sidecar process)",
    )
    parser.add_argument("--probe", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(probe(args.probe, args.seconds)))
        return 0
    results = run(args.seconds, [c for c in args.cases.split(",") if c], not args.no_control)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.out is not None:
        write_section(args.out, "bench-isolation", render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
