"""`make bounds-check`: a flood of distinct engines cannot grow the sidecar's memory.

Starts a real `nightjar-server` process with its default bounds (policy_server/engines.py),
asks it for a decision table for each of N distinct engine ids (default 100,000), each
with its own learner key, and reports a step run from each table but never its outcome
(so every engine leaves a table and a pending step behind), over one pipelined
StepStream, and samples the server's resident memory (/proc/PID/status VmRSS).
Passes when RSS at the end is within 10 % (plus 8 MiB of allocator slack) of RSS once the
engine table first filled up, and when the evictions were counted in
nightjar_evictions_total. Writes docs/reliability/bounded-memory.json.

    python -m benchmarks.bounds_check [--engines 100000] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import queue
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from nightjar_proto.v1 import policy_pb2, policy_pb2_grpc

from benchmarks.host import cpu, free_port
from policy_server.engines import Bounds

DEFAULT_OUT = Path("docs/reliability/bounded-memory.json")
# Allowed growth after the table filled: relative, plus allocator slack.
GROWTH_LIMIT = 0.10
SLACK_BYTES = 8 << 20


@dataclasses.dataclass(frozen=True)
class Result:
    engines: int
    errors: int
    rss_full_bytes: int  # when the engine table first filled (max_engines engines seen)
    rss_end_bytes: int
    rss_samples: list[tuple[int, int]]  # (tables answered, RSS bytes)
    evictions: dict[str, float]
    seconds: float

    @property
    def growth(self) -> float:
        return self.rss_end_bytes / self.rss_full_bytes - 1.0

    @property
    def passed(self) -> bool:
        bounds = Bounds()
        return (
            self.errors == 0
            and self.rss_end_bytes <= self.rss_full_bytes * (1 + GROWTH_LIMIT) + SLACK_BYTES
            and self.evictions.get("engine", 0) >= self.engines - bounds.max_engines
            and self.evictions.get("learner_key", 0) >= self.engines - bounds.max_learner_keys
        )


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def evictions(metrics_port: int) -> dict[str, float]:
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:  # loopback
        text = response.read().decode()
    counts = {}
    for line in text.splitlines():
        if line.startswith('nightjar_evictions_total{kind="'):
            labels, value = line.rsplit(" ", 1)
            counts[labels.split('"')[1]] = float(value)
    return counts


class Flood:
    """The requests of the flood, pipelined: a table request for each engine in turn, and
    the step each engine ran from its table as soon as the table is in (the reply loop
    hands it back through :meth:`answered`). At most :attr:`WINDOW` table requests are
    unanswered at a time, so that each step comes while its engine is still held (gRPC
    would otherwise send thousands of contexts ahead of the first answer). Half-closes
    once every engine is answered."""

    WINDOW = 64

    def __init__(self, engines: int, seed: int = 0) -> None:
        self.engines = engines
        self._rng = random.Random(seed)
        self._seq = 0
        # A step to report, or None for a context answered without a table (an error).
        self._answered: queue.SimpleQueue[policy_pb2.RanStep | None] = queue.SimpleQueue()
        self.contexts: dict[int, policy_pb2.StepContext] = {}  # by seq, until answered

    def _next(self, request: policy_pb2.StepRequest) -> policy_pb2.StepRequest:
        self._seq += 1
        request.seq = self._seq
        return request

    def answered(self, reply: policy_pb2.StepReply) -> bool:
        """Take the reply to a table request (True), handing its ran step back; False for
        the reply to a report."""
        ctx = self.contexts.pop(reply.seq, None)
        if ctx is None:
            return False
        table = reply.table
        if reply.HasField("error") or not table.table_id:
            self._answered.put(None)
            return True
        gamma = table.gammas[ctx.batch_size - table.first_batch_size]
        self._answered.put(
            policy_pb2.RanStep(decision_id=f"{table.table_id}.1", context=ctx, gamma=gamma)
        )
        return True

    def __iter__(self) -> Iterator[policy_pb2.StepRequest]:
        resolved = 0
        for i in range(self.engines):
            ctx = policy_pb2.StepContext(
                engine_id=f"flood-{i}",
                learner_key=f"model-{i}@device",
                batch_size=self._rng.randint(1, 64),
                total_kv_blocks=4096,
                free_kv_blocks=2048,
                draft_resident=True,
            )
            request = self._next(policy_pb2.StepRequest(context=ctx))
            self.contexts[request.seq] = ctx
            yield request
            while not self._answered.empty() or i + 1 - resolved >= self.WINDOW:
                resolved += 1
                if (ran := self._answered.get(timeout=60)) is not None:
                    yield self._next(policy_pb2.StepRequest(ran_steps=[ran]))
        while resolved < self.engines:  # the last tables' steps
            resolved += 1
            if (ran := self._answered.get(timeout=60)) is not None:
                yield self._next(policy_pb2.StepRequest(ran_steps=[ran]))


def run(engines: int, sample_every: int = 5000) -> Result:
    """Flood a fresh server process with ``engines`` distinct engine ids."""
    full_at = Bounds().max_engines
    with tempfile.TemporaryDirectory(prefix="nj-bounds-") as tmp:
        sock = Path(tmp) / "s.sock"
        metrics_port = free_port()
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "policy_server.cli",
                "--uds",
                str(sock),
                "--metrics-port",
                str(metrics_port),
                "--log-level",
                "WARNING",
            ],
        )
        channel = grpc.insecure_channel(f"unix:{sock}")
        try:
            grpc.channel_ready_future(channel).result(timeout=30)
            stub = policy_pb2_grpc.PolicyServiceStub(channel)
            started = time.monotonic()
            samples: list[tuple[int, int]] = []
            rss_full, tables, reported = 0, 0, 0
            flood = Flood(engines)
            for reply in stub.StepStream(iter(flood)):
                if reply.seq == 0 and reply.policy_version:  # the stream's policy notice
                    continue
                if not flood.answered(reply):  # a report's reply
                    if not reply.HasField("error") and not reply.skipped:
                        reported += 1
                elif not reply.HasField("error") and reply.table.table_id:
                    tables += 1
                    if tables == full_at:
                        rss_full = rss_bytes(server.pid)
                    if tables % sample_every == 0:
                        samples.append((tables, rss_bytes(server.pid)))
            seconds = time.monotonic() - started
            end = (tables, rss_bytes(server.pid))  # every step reported by now
            if samples and samples[-1][0] == tables:
                samples[-1] = end
            else:
                samples.append(end)
            counted = evictions(metrics_port)
            return Result(
                engines,
                (engines - tables) + (engines - reported),  # not answered as asked
                rss_full or samples[0][1],
                samples[-1][1],
                samples,
                counted,
                seconds,
            )
        finally:
            channel.close()
            server.terminate()
            server.wait(timeout=15)


def record(result: Result) -> dict[str, Any]:
    mib = 1 << 20
    return {
        "test": "bounded memory",
        "what": (
            f"{result.engines:,} distinct engine ids (each its own learner key, a table and "
            "a step run from it, no outcome) over one StepStream to a real nightjar-server "
            "with default bounds "
            f"({Bounds().max_engines} engines, {Bounds().max_learner_keys} learner keys, "
            f"{Bounds().max_pending_per_engine} pending per engine)"
        ),
        "figure": (
            f"RSS {result.rss_full_bytes / mib:.1f} MiB when the engine table filled → "
            f"{result.rss_end_bytes / mib:.1f} MiB after {result.engines:,} engines "
            f"({result.growth:+.1%}); evictions engine {result.evictions.get('engine', 0):,.0f}"
            f", learner_key {result.evictions.get('learner_key', 0):,.0f}; "
            f"{result.errors} errors; {result.engines / result.seconds:,.0f} engines/s (a "
            "table and a step each)"
        ),
        "passed": result.passed,
        "date": datetime.date.today().isoformat(),
        "machine": cpu(),
        "command": "make bounds-check",
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bounds-check", description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=100_000)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    result = run(args.engines)
    entry = record(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(entry, indent=2) + "\n")
    print(json.dumps({**entry, "rss_samples": result.rss_samples}, indent=2))
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
