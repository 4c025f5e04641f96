"""`make bench-instructions`: the CPU instructions an engine step through decision tables
costs in process, counted by valgrind's callgrind instead of timed.

A count does not depend on how fast a shared host happens to run: on the 2-vCPU VMs this
project is measured on, the same walk timed 11 and 17 µs a step a minute apart, more than
most changes to the decision path are worth. The walk is `make bench-rpc`'s table case
(`benchmarks/rpc.py` measure_tables: a batch that moves by a request or two a step, a
table refreshed every 32 steps or when the batch nears its edge): the client's lookup,
the sidecar deciding each table and learning from the reported steps; and the same walk
with the default's per-request mode, every request named (`make bench-rpc`'s
per-request row: each refresh also plans the context's own batch size request by
request), beside that walk with the mode off: the two differ by the mode's own work
alone (naming the requests and making their outcomes is the walk's, counted in both).
Each runs under callgrind for two lengths; the difference over the steps between them is
what a steady step costs (start-up, imports and the warm-up are common to both).

Needs valgrind (Debian: `apt-get install valgrind`; the target installs it).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.host import machine
from benchmarks.report import write_section
from benchmarks.rpc import measure_tables
from benchmarks.rpc_report import TABLE_REFRESHES, TableWalk, table_walks

SECTION = "bench-instructions"
WARM_STEPS = 2_000
# The two walk lengths: both past the warm-up and the engine's first learning.
SHORT, LONG = 3_000, 5_000
# What a walk's row adds to its period (the named walks run at the client's default).
ROW_NAMES = {
    TableWalk.BATCH: "",
    TableWalk.NAMED: ", every request named, the per-request mode off",
    TableWalk.PER_REQUEST: ", every request named, the per-request mode (the same walk)",
}


def walk(steps: int, refresh_steps: int, kind: TableWalk = TableWalk.BATCH) -> None:
    """The table walk of ``steps`` steps (what each callgrind run executes)."""
    measure_tables(steps, WARM_STEPS, refresh_steps, kind)


def collected(log: str) -> int:
    """The instruction count in callgrind's summary on stderr."""
    match = re.search(r"Collected : (\d+)", log)
    if match is None:
        raise RuntimeError(f"callgrind reported no instruction count:\n{log[-2000:]}")
    return int(match.group(1))


def count(steps: int, refresh_steps: int, kind: TableWalk = TableWalk.BATCH) -> int:
    """Instructions of a whole process that walks ``steps`` steps, under callgrind (address
    randomisation off and a fixed hash seed, so that a run repeats its count)."""
    with tempfile.TemporaryDirectory() as scratch:
        command = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={Path(scratch) / 'callgrind.out'}",
            sys.executable,
            "-m",
            "benchmarks.step_instructions",
            "--walk",
            str(steps),
            "--refreshes",
            str(refresh_steps),
            "--kind",
            kind.name,
        ]
        if shutil.which("setarch"):
            command = ["setarch", "-R", *command]
        env = {**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1"}
        run = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return collected(run.stderr)


def per_step(short: int, long: int, steps: int) -> float:
    """A steady step's instructions: the longer walk's extra count over its extra steps."""
    if long <= short:
        raise RuntimeError(f"the longer walk counted {long:,} <= the shorter's {short:,}")
    return (long - short) / steps


def render(rows: Sequence[tuple[int, TableWalk, float]], version: str) -> str:
    lines = [
        "## Instructions per engine step through decision tables (`make bench-instructions`)",
        "",
        f"Counted {datetime.date.today().isoformat()} on {machine()}, numpy {np.__version__}, "
        f"by `make bench-instructions` (`benchmarks/step_instructions.py`) with {version}'s "
        f"callgrind: `make bench-rpc`'s table walk run for {SHORT:,} and {LONG:,} steps, the "
        f"difference over the {LONG - SHORT:,} steps between. A step: the client's lookup in "
        "the held table, and on a refresh the sidecar applying the reported steps (learning) "
        "and deciding the next table. Counts do not depend on the host's speed; they do on "
        "the Python, numpy and OpenBLAS builds.",
        "",
        "| table refreshed every | instructions per step |",
        "|---:|---:|",
    ]
    lines += [
        f"| {refresh} steps{ROW_NAMES[kind]} | {value:,.0f} |" for refresh, kind, value in rows
    ]
    by_kind = {kind: value for _, kind, value in rows}
    if TableWalk.NAMED in by_kind and TableWalk.PER_REQUEST in by_kind:
        own = by_kind[TableWalk.PER_REQUEST] - by_kind[TableWalk.NAMED]
        lines += [
            "",
            f"The per-request mode's own work: {own:,.0f} instructions a step (its row less "
            "the same walk's with the mode off: naming the requests and making their "
            "outcomes is the walk's own, in both).",
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-instructions", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"))
    parser.add_argument(
        "--refreshes", type=int, nargs="+", default=list(TABLE_REFRESHES), metavar="STEPS"
    )
    parser.add_argument("--walk", type=int, help=argparse.SUPPRESS)  # the counted process
    parser.add_argument(
        "--kind", choices=[k.name for k in TableWalk], default="BATCH", help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.walk is not None:
        walk(args.walk, args.refreshes[0], TableWalk[args.kind])
        return 0
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not installed (Debian: apt-get install valgrind)")
    version = subprocess.run(
        ["valgrind", "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    rows = []
    for refresh, kind in table_walks(args.refreshes):
        print(f"refresh every {refresh} steps, {kind.name} walk ...", file=sys.stderr)
        short, long = count(SHORT, refresh, kind), count(LONG, refresh, kind)
        rows.append((refresh, kind, per_step(short, long, LONG - SHORT)))
    write_section(args.out, SECTION, render(rows, version))
    print(render(rows, version))
    return 0


if __name__ == "__main__":
    sys.exit(main())
