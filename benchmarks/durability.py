"""Durable state, shown by killing and starving real processes (`make reliability-durable`).

1. Kill loop: a writer process snapshots a real learned state (a DecisionService's
   snapshot document of 200 engines × 64 batch sizes, ~0.9 MB) with
   :func:`policy_server.snapshot.write_atomic` over and over; it is SIGKILLed at a random
   moment, many times. Before each write it journals (fsynced) the digest of the document
   it is about to write, so after the kill ``snapshot.json`` must be, byte for byte, the
   last complete document (old) or the one in flight (new), never a mix, a prefix or
   nothing. Then a fresh ``nightjar-server``
   starts on the directory: it must restore exactly that state and remove the temporary
   files the killed writers left.
2. A state directory that cannot be written (the path is a file: ENOTDIR/EEXIST whoever
   runs it, root included, where a read-only mode would not stop root): snapshots fail,
   are logged and counted, the server stays SERVING and decides on.
3. A disk that fills during a write (RLIMIT_FSIZE on the server process: EFBIG half-way
   through, as ENOSPC would): the failed snapshot leaves the previous one intact and no
   temporary file.

SIGKILL is not a power cut: the page cache survives it. What power loss adds is covered by
the fsyncs of the file and of the directory in write_atomic (the rename is only made
durable after the data is).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import logging
import multiprocessing
import os
import random
import resource
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from nightjar_proto.v1 import admin_pb2

from benchmarks.durability_server import running_server
from benchmarks.host import machine
from nightjar_common.types import StepContext
from policy_server import snapshot
from policy_server.service import DecisionService

SNAPSHOT_FAILED = ("nightjar_snapshots_total", (("result", "failed"),))
LAST_SUCCESS = "nightjar_snapshot_last_success_timestamp_seconds"


# -- 1. kill loop ---------------------------------------------------------------------------


def grow(decide: Callable[[str, int], object], engine: int, batch_sizes: int = 64) -> int:
    """Learned state for one more engine: a schedule for each of ``batch_sizes`` contexts
    (kept under the server's engine bound, policy_server/engines.py). Returns decisions."""
    for batch_size in range(1, batch_sizes + 1):
        decide(f"engine-{engine}", batch_size)
    return batch_sizes


def learned_state(engines: int, seed: int = 0) -> dict[str, Any]:
    """A snapshot document of a nightjar policy that has seen ``engines`` engines."""
    service = DecisionService("nightjar", {"seed": seed})
    for engine in range(engines):
        grow(lambda e, b: service.run_step(StepContext(e, batch_size=b)), engine)
    return service.snapshot_document()


def _writer(state_dir: str, journal: str, base: dict[str, Any]) -> None:
    """The killed process: decide a little, journal the next document's digest, write it."""
    logging.disable(logging.WARNING)  # the policy's start-up notes, once per process
    service = DecisionService("nightjar", base["policy"]["params"])
    service.restore_document(base, from_client=False)
    path = Path(state_dir) / snapshot.SNAPSHOT_NAME
    with open(journal, "ab") as log:
        for step in range(1 << 30):
            service.run_step(StepContext(f"writer-{step % 97}", batch_size=1 + step % 64))
            data = snapshot.encode(service.snapshot_document())
            log.write(hashlib.sha256(data).hexdigest().encode() + b"\n")
            log.flush()
            os.fsync(log.fileno())
            snapshot.write_bytes_atomic(path, data)  # write_atomic after its encode


@dataclasses.dataclass
class KillLoopResult:
    kills: int = 0
    write_s: float = 0.0  # one write of the encoded document, measured
    # After a kill: the last complete document / the one in flight / anything else.
    old: int = 0
    new: int = 0
    bad: list[str] = dataclasses.field(default_factory=list)
    temp_files_left: int = 0  # kills that left a temporary file: killed mid-write
    document_bytes: int = 0
    writes_journaled: int = 0
    # The fresh server on the directory afterwards.
    restored_identical: bool = False
    leftovers_after_start: int = -1

    @property
    def passed(self) -> bool:
        return (
            not self.bad
            and self.old + self.new == self.kills > 0
            and self.restored_identical
            and self.leftovers_after_start == 0
        )


def kill_loop(workdir: Path, iterations: int, engines: int = 200, seed: int = 0) -> KillLoopResult:
    """Each kill comes at a uniform moment within 1.5 times the duration of one write
    (measured first) after the writer journaled its first document, so it lands in every
    phase of the write (temporary file, write, fsync, rename, directory fsync) and just
    after it."""
    rng = random.Random(seed)
    state_dir = workdir / "state"
    state_dir.mkdir(parents=True, exist_ok=True)
    base = learned_state(engines, seed)
    path = state_dir / snapshot.SNAPSHOT_NAME
    snapshot.write_atomic(path, base)
    result = KillLoopResult(document_bytes=len(snapshot.encode(base)))
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    journal = workdir / "journal"

    def run_writer(delay: Callable[[], float]) -> list[str]:
        journal.write_bytes(b"")
        writer = context.Process(target=_writer, args=(str(state_dir), str(journal), base))
        writer.start()
        deadline = time.monotonic() + 60
        while not journal.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.001)  # the first write is under way
        time.sleep(delay())
        assert writer.pid is not None
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
        return journal.read_text().split()

    scratch, data = state_dir / "calibration.json", snapshot.encode(base)
    started = time.perf_counter()
    for _ in range(3):
        snapshot.write_bytes_atomic(scratch, data)
    result.write_s = (time.perf_counter() - started) / 3
    scratch.unlink()
    previous = hashlib.sha256(path.read_bytes()).hexdigest()

    def temp_files() -> set[Path]:
        return set(state_dir.glob(f"{snapshot.TEMP_PREFIX}*"))

    for kill in range(iterations):
        left_before = temp_files()
        digests = run_writer(lambda: rng.uniform(0.0, 1.5 * result.write_s))
        result.kills += 1
        result.writes_journaled += len(digests)
        result.temp_files_left += bool(temp_files() - left_before)
        on_disk = path.read_bytes() if path.exists() else b""
        found = hashlib.sha256(on_disk).hexdigest()
        last_complete = digests[-2] if len(digests) > 1 else previous
        if found == digests[-1]:
            result.new += 1
        elif found == last_complete:
            result.old += 1
        else:
            result.bad.append(f"kill {kill}: snapshot.json ({len(on_disk)} bytes) is neither")
            continue
        try:
            snapshot.parse(on_disk, str(path))
        except snapshot.SnapshotError as exc:
            result.bad.append(f"kill {kill}: {exc}")
        previous = found
    expected = snapshot.read(path)["policy"]["state"]
    with running_server(workdir, ["--state-dir", str(state_dir)]) as server:
        reply = server.admin.GetState(admin_pb2.GetStateRequest(), timeout=30)
        result.restored_identical = json.loads(reply.state_json) == json.loads(json.dumps(expected))
        result.leftovers_after_start = len(temp_files())
    return result


# -- 2. and 3. a state directory that cannot be written ---------------------------------------


@dataclasses.dataclass
class StarvedResult:
    name: str
    snapshot_code: str = ""
    failures_counted: float = 0.0
    last_success_unchanged: bool = False
    decisions_during: int = 0
    serving: bool = False
    logged: bool = False
    previous_intact: bool = True  # the snapshot written before the failure
    temp_files_left: int = 0

    @property
    def passed(self) -> bool:
        return (
            self.snapshot_code == "FAILED_PRECONDITION"
            and self.failures_counted >= 1
            and self.last_success_unchanged
            and self.decisions_during > 0
            and self.serving
            and self.logged
            and self.previous_intact
            and self.temp_files_left == 0
        )


def state_dir_is_a_file(workdir: Path, decisions: int = 200) -> StarvedResult:
    blocked = workdir / "not-a-directory"
    blocked.write_text("a file where the state directory should be\n")
    result = StarvedResult("state directory unwritable")
    with running_server(
        workdir, ["--state-dir", str(blocked), "--snapshot-interval", "0.1"]
    ) as server:
        for i in range(decisions):  # across several failed periodic snapshots
            server.decide(f"e{i % 8}", 1 + i % 16)
            result.decisions_during += 1
            time.sleep(0.002)
        result.snapshot_code = server.snapshot_code().name
        result.failures_counted = server.metric(*SNAPSHOT_FAILED)
        result.last_success_unchanged = server.metric(LAST_SUCCESS) == 0.0
        result.serving = server.serving()
        result.logged = "snapshot failed" in server.log()
    return result


def disk_fills_mid_write(workdir: Path, limit_bytes: int = 64 << 10) -> StarvedResult:
    """RLIMIT_FSIZE caps every file the server writes: the first snapshot fits, the one
    after many engines do not, and fails half-way through writing its temporary file."""
    state_dir = workdir / "state-full"
    path = state_dir / snapshot.SNAPSHOT_NAME
    result = StarvedResult("disk full during a snapshot")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    # No periodic snapshots: the one before the failure is the RPC's below.
    args = ["--state-dir", str(state_dir), "--log-level", "WARNING", "--snapshot-interval", "3600"]
    with running_server(workdir, args, preexec=limit) as server:
        assert server.snapshot_code() == grpc.StatusCode.OK, server.log()
        before, success = path.read_bytes(), server.metric(LAST_SUCCESS)
        state_bytes = 0
        for engine in range(200):  # grow the learned state past the limit
            result.decisions_during += grow(server.decide, engine)
            reply = server.admin.GetState(admin_pb2.GetStateRequest(), timeout=30)
            state_bytes = len(reply.state_json)
            if state_bytes > 2 * limit_bytes:
                break
        result.snapshot_code = server.snapshot_code().name
        result.failures_counted = server.metric(*SNAPSHOT_FAILED)
        result.last_success_unchanged = server.metric(LAST_SUCCESS) == success
        result.previous_intact = path.read_bytes() == before
        result.temp_files_left = len(list(state_dir.glob(f"{snapshot.TEMP_PREFIX}*")))
        server.decide("after", 4)
        result.serving = server.serving()
    result.logged = "File too large" in server.log()
    return result


# -- report -----------------------------------------------------------------------------------


def records(
    kills: KillLoopResult, starved: list[StarvedResult], command: str
) -> list[dict[str, Any]]:
    date, host = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"), machine()

    def record(test: str, what: str, figure: str, passed: bool) -> dict[str, Any]:
        return {
            "test": test,
            "what": what,
            "figure": figure,
            "passed": passed,
            "date": date,
            "machine": host,
            "command": command,
        }

    out = [
        record(
            "durable state: SIGKILL during snapshot writes",
            f"a writer process SIGKILLed at a random moment of its snapshot loop "
            f"({kills.document_bytes / 1e6:.1f} MB documents, write-temp + fsync + rename + "
            "directory fsync), then a fresh nightjar-server started on the directory",
            f"{kills.kills} kills within 1.5 writes of {1000 * kills.write_s:.0f} ms: "
            f"snapshot.json old {kills.old}, new {kills.new}, torn or "
            f"unknown {len(kills.bad)}; {kills.temp_files_left} kills were mid-write (a "
            f"temporary file left); the server restored the state "
            f"{'identically' if kills.restored_identical else 'NOT identically'} and left "
            f"{kills.leftovers_after_start} temporary files",
            kills.passed,
        )
    ]
    for s in starved:
        out.append(
            record(
                f"durable state: {s.name}",
                "a real nightjar-server whose state directory is a file (ENOTDIR/EEXIST)"
                if s.name.startswith("state directory")
                else "a real nightjar-server under RLIMIT_FSIZE, its learned state grown past "
                "it (EFBIG half-way through the temporary file, as a full disk)",
                f"Snapshot → {s.snapshot_code}; nightjar_snapshots_total{{result=failed}} = "
                f"{s.failures_counted:.0f}; last-success gauge "
                f"{'unchanged' if s.last_success_unchanged else 'CHANGED'}; "
                f"{s.decisions_during} decisions answered meanwhile; "
                f"{'SERVING' if s.serving else 'NOT SERVING'}" + _previous_snapshot(s),
                s.passed,
            )
        )
    return out


def _previous_snapshot(s: StarvedResult) -> str:
    if s.name.startswith("state directory"):
        return ""  # there was none
    intact = "intact" if s.previous_intact else "DAMAGED"
    return f"; previous snapshot {intact}, {s.temp_files_left} temporary files left"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.durability", description=__doc__)
    p.add_argument("--iterations", type=int, default=100, help="SIGKILLs (default 100)")
    p.add_argument("--out", type=Path, default=Path("docs/reliability/durable-state.json"))
    p.add_argument("--command", default="make reliability-durable", help="as shown in the report")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nightjar-durable-") as tmp:
        work = Path(tmp)
        kills = kill_loop(work / "kills", args.iterations)
        (work / "file").mkdir()
        (work / "full").mkdir()
        starved = [state_dir_is_a_file(work / "file"), disk_fills_mid_write(work / "full")]
    out = records(kills, starved, args.command)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    for entry in out:
        print(f"{'PASS' if entry['passed'] else 'FAIL'} {entry['test']}: {entry['figure']}")
    for problem in kills.bad[:10]:
        print("  ", problem)
    return 0 if all(entry["passed"] for entry in out) else 1


if __name__ == "__main__":
    sys.exit(main())
