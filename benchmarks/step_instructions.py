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
alone. Each runs under callgrind for two lengths; the difference over the steps between
them is what a steady step costs (start-up, imports and the warm-up are common to both).
From it the walk's own building of each step's context and outcome is subtracted,
counted the same way by the walk run with no client or sidecar asked: named requests
make the benchmark build objects per request that an engine's plugin builds anyway, and
counted in the walk they would be charged to the sidecar.

Beside the walks, the plugin's hook on the engine's thread: `benchmarks/hook_cost.py`'s
driver steps the controller (`decide`, the per-request γ, `end_step`, as the scheduler
hook calls them) against a real sidecar process (this tree's, started natively for each
run: every revision counted meets the same sidecar), with a forward pass between hooks
(the client's tables age on the walk's clock, not the wall clock callgrind slows).
Callgrind counts each thread apart (``--separate-threads``): the engine's thread is the
hook's count; the client's own threads (its sender, gRPC's) are counted beside it.
Beside the controller, the scheduler's per-request walks (``batch_shape``,
``verified_step``) on vLLM's own objects, a decode batch of each of WALK_SIZES
(`benchmarks/scheduler_walks.py`; where vLLM is installed): one process under callgrind,
its instrumentation switched on after vLLM's imports, a dump of the counts after each walk.
``--baseline REV`` counts the hook at another commit too (its tree from ``git archive``),
so that a change's before and after are counted by the same valgrind, Python and host.

Needs valgrind (Debian: `apt-get install valgrind`; the target installs it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from benchmarks.hook_cost import BATCH, STEP_S, walk_hook
from benchmarks.host import machine
from benchmarks.report import write_section
from benchmarks.rpc import measure_tables, sidecar
from benchmarks.rpc_report import TABLE_REFRESHES, TableWalk, table_walks

SECTION = "bench-instructions"
WARM_STEPS = 2_000
# The two walk lengths: both past the warm-up and the engine's first learning.
SHORT, LONG = 3_000, 5_000
# What a walk's row adds to its period (the named walks run at the client's default).
# The hook's two lengths and warm-up (steps): a refresh every 32 steps, the sidecar's
# learning settled.
HOOK_WARM, HOOK_SHORT, HOOK_LONG = 500, 1_000, 3_000
# The scheduler walks' batch sizes (a saturated engine's decode batch reaches 64) and
# their two lengths (steps).
WALK_SIZES = (32, 64)
WALK_SHORT, WALK_LONG = 200, 1_200
ROW_NAMES = {
    TableWalk.BATCH: "",
    TableWalk.NAMED: ", every request named, the per-request mode off",
    TableWalk.PER_REQUEST: ", every request named, the per-request mode (the same walk)",
}


def walk(
    steps: int, refresh_steps: int, kind: TableWalk = TableWalk.BATCH, inputs_only: bool = False
) -> None:
    """The table walk of ``steps`` steps (what each callgrind run executes); ``inputs_only``:
    the walk's own building of its steps alone."""
    measure_tables(steps, WARM_STEPS, refresh_steps, kind, inputs_only)


def collected(log: str) -> int:
    """The instruction count in callgrind's summary on stderr."""
    match = re.search(r"Collected : (\d+)", log)
    if match is None:
        raise RuntimeError(f"callgrind reported no instruction count:\n{log[-2000:]}")
    return int(match.group(1))


def hook_walk(steps: int, target: str) -> None:
    """The hook's walk of ``steps`` steps after the warm-up against the sidecar at
    ``target``; prints its table misses and fallbacks."""
    print(walk_hook(target, steps, HOOK_WARM))


def scheduler_walks(sizes: Sequence[int]) -> None:
    """The scheduler walks' counted process (vLLM imported only here)."""
    from benchmarks.scheduler_walks import counted_walks

    counted_walks(sizes, (WALK_SHORT, WALK_LONG))


@dataclasses.dataclass(frozen=True)
class ThreadCounts:
    """A counted run's instructions: the main (engine's) thread's, the other threads'; the
    counted process's report (its table misses and fallbacks)."""

    engine: int
    others: int
    misses: int = 0
    fallbacks: int = 0


def thread_totals(out_files: Sequence[Path]) -> ThreadCounts:
    """Per-thread totals of a ``--separate-threads`` run: thread 1 is the main thread."""
    engine = others = 0
    for path in out_files:
        text = path.read_text()
        thread = re.search(r"^thread: (\d+)$", text, re.M)
        total = re.search(r"^totals: (\d+)", text, re.M)
        if thread is None or total is None:
            continue
        if int(thread.group(1)) == 1:
            engine += int(total.group(1))
        else:
            others += int(total.group(1))
    if not engine:
        raise RuntimeError("callgrind wrote no count for the main thread")
    return ThreadCounts(engine, others)


def part_totals(out_files: Sequence[Path]) -> list[int]:
    """The totals of a run's dumped parts, in the order callgrind dumped them."""
    parts = []
    for path in out_files:
        text = path.read_text()
        part = re.search(r"^part: (\d+)$", text, re.M)
        total = re.search(r"^totals: (\d+)", text, re.M)
        if part is not None and total is not None:
            parts.append((int(part.group(1)), int(total.group(1))))
    return [total for _, total in sorted(parts)]


def _callgrind(
    out_file: Path,
    arguments: Sequence[str],
    separate_threads: bool = False,
    instrumented: bool = True,
) -> list[str]:
    """The command that runs ``python -m benchmarks.step_instructions ARGUMENTS`` under
    callgrind (address randomisation off where setarch exists); ``instrumented`` false:
    the process switches the instrumentation on itself."""
    command = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={out_file}",
        *(["--separate-threads=yes"] if separate_threads else []),
        *([] if instrumented else ["--instr-atstart=no"]),
        sys.executable,
        "-m",
        "benchmarks.step_instructions",
        *arguments,
    ]
    return ["setarch", "-R", *command] if shutil.which("setarch") else command


def _counting_env(tree: Path) -> dict[str, str]:
    """A fixed hash seed, one BLAS thread; ``tree``'s packages first on the path."""
    path = os.pathsep.join([str(tree), str(tree / "proto")])
    return {**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": path}


def count_hook(steps: int, tree: Path) -> ThreadCounts:
    """Instructions of a process that steps the hook ``steps`` times after its warm-up
    (the code of ``tree``), by thread, under callgrind, against a fresh sidecar process of
    this tree's (run natively: the same sidecar for every revision counted)."""
    with tempfile.TemporaryDirectory() as scratch, sidecar("uds") as target:
        out_file = Path(scratch) / "callgrind.out"
        arguments = ["--hook", str(steps), "--target", target]
        command = _callgrind(out_file, arguments, separate_threads=True)
        run = subprocess.run(
            command, cwd=tree, env=_counting_env(tree), capture_output=True, text=True, check=True
        )
        counts = thread_totals(sorted(Path(scratch).glob("callgrind.out-*")))
    report = json.loads(run.stdout.strip().splitlines()[-1])
    return dataclasses.replace(counts, misses=report["table_misses"], fallbacks=report["fallbacks"])


def count_walks(tree: Path, sizes: Sequence[int] = WALK_SIZES) -> tuple[tuple[int, float], ...]:
    """The scheduler walks' instructions per step at each batch size (the code of
    ``tree``): one process, a part dumped after each walk, the first part the switch's."""
    with tempfile.TemporaryDirectory() as scratch:
        arguments = ["--walks", *map(str, sizes)]
        command = _callgrind(Path(scratch) / "callgrind.out", arguments, instrumented=False)
        subprocess.run(
            command, cwd=tree, env=_counting_env(tree), capture_output=True, text=True, check=True
        )
        parts = part_totals(sorted(Path(scratch).glob("callgrind.out*")))
    return walk_steps(parts, sizes)


def walk_steps(parts: Sequence[int], sizes: Sequence[int]) -> tuple[tuple[int, float], ...]:
    """Per batch size, a step's count from the walks' parts: the switch's part, then a
    short and a long walk for each size in turn (a last part, the exit's, is not read)."""
    walks = parts[1:]
    if len(walks) < 2 * len(sizes):
        raise RuntimeError(f"callgrind dumped {len(parts)} parts for {len(sizes)} batch sizes")
    steps = WALK_LONG - WALK_SHORT
    return tuple(
        (size, per_step(walks[2 * n], walks[2 * n + 1], steps)) for n, size in enumerate(sizes)
    )


def walks_counted(tree: Path) -> bool:
    """Whether the scheduler walks can be counted at ``tree``: vLLM installed, and the
    walks' driver in that revision."""
    installed = importlib.util.find_spec("vllm") is not None
    return installed and (tree / "benchmarks" / "scheduler_walks.py").exists()


@dataclasses.dataclass(frozen=True)
class HookRow:
    """The hook's count per step at one revision (``label``): the engine thread's, the
    client's other threads', and the misses and fallbacks in the longer run's extra
    steps; the scheduler walks' per step by batch size, where counted."""

    label: str
    engine: float
    others: float
    misses: int
    fallbacks: int
    walks: tuple[tuple[int, float], ...] = ()


def hook_row(label: str, tree: Path) -> HookRow:
    short, long = count_hook(HOOK_SHORT, tree), count_hook(HOOK_LONG, tree)
    steps = HOOK_LONG - HOOK_SHORT
    return HookRow(
        label,
        per_step(short.engine, long.engine, steps),
        per_step(short.others, long.others, steps),
        long.misses - short.misses,
        long.fallbacks - short.fallbacks,
        count_walks(tree) if walks_counted(tree) else (),
    )


@contextlib.contextmanager
def revision_tree(revision: str) -> Iterator[Path]:
    """The repository's files at ``revision`` in a scratch directory (``git archive``)."""
    with tempfile.TemporaryDirectory(prefix="nj-rev-") as scratch:
        archive = subprocess.run(
            ["git", "archive", "--format=tar", revision], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", scratch], input=archive, check=True)
        yield Path(scratch)


def hook_rows(baseline: str | None) -> list[HookRow]:
    """The hook's count at HEAD's working tree, and at ``baseline`` first when given."""
    rows = []
    if baseline:
        print(f"the hook at {baseline} ...", file=sys.stderr)
        with revision_tree(baseline) as tree:
            rows.append(hook_row(baseline, tree))
    print("the hook ...", file=sys.stderr)
    rows.append(hook_row("this tree", Path.cwd()))
    return rows


def walks_lines(baseline: str | None) -> list[str]:
    """The scheduler walks' count per step at ``baseline`` (when given) and this tree."""
    trees: list[tuple[str, contextlib.AbstractContextManager[Path]]] = []
    if baseline:
        trees.append((baseline, revision_tree(baseline)))
    trees.append(("this tree", contextlib.nullcontext(Path.cwd())))
    lines = []
    for label, opened in trees:
        with opened as tree:
            walks = count_walks(tree)
        lines += [f"{label}, batch {size}: {n:,.0f}" for size, n in walks]
    return lines


def count(
    steps: int, refresh_steps: int, kind: TableWalk = TableWalk.BATCH, inputs_only: bool = False
) -> int:
    """Instructions of a whole process that walks ``steps`` steps, under callgrind (address
    randomisation off and a fixed hash seed, so that a run repeats its count)."""
    arguments = ["--walk", str(steps), "--refreshes", str(refresh_steps), "--kind", kind.name]
    arguments += ["--inputs-only"] if inputs_only else []
    with tempfile.TemporaryDirectory() as scratch:
        command = _callgrind(Path(scratch) / "callgrind.out", arguments)
        run = subprocess.run(
            command, env=_counting_env(Path.cwd()), capture_output=True, text=True, check=True
        )
    return collected(run.stderr)


def walk_step(refresh_steps: int, kind: TableWalk) -> float:
    """A steady step of the walk, less the walk's own building of the step's context and
    outcome (counted alone): what the client and the sidecar execute."""
    product, inputs = (
        per_step(
            count(SHORT, refresh_steps, kind, alone),
            count(LONG, refresh_steps, kind, alone),
            LONG - SHORT,
        )
        for alone in (False, True)
    )
    return product - inputs


def per_step(short: int, long: int, steps: int) -> float:
    """A steady step's instructions: the longer walk's extra count over its extra steps."""
    if long <= short:
        raise RuntimeError(f"the longer walk counted {long:,} <= the shorter's {short:,}")
    return (long - short) / steps


def render(
    rows: Sequence[tuple[int, TableWalk, float]], version: str, hooks: Sequence[HookRow] = ()
) -> str:
    lines = [
        "## Instructions per engine step through decision tables (`make bench-instructions`)",
        "",
        f"Counted {datetime.date.today().isoformat()} on {machine()}, numpy {np.__version__}, "
        f"by `make bench-instructions` (`benchmarks/step_instructions.py`) with {version}'s "
        f"callgrind: `make bench-rpc`'s table walk run for {SHORT:,} and {LONG:,} steps, the "
        f"difference over the {LONG - SHORT:,} steps between, less the same walk's own "
        "building of its steps' contexts and outcomes (that walk run with no client or "
        "sidecar asked, counted the same way). A step: the client's lookup in the held "
        "table, and on a refresh the sidecar applying the reported steps (learning) and "
        "deciding the next table. Counts do not depend on the host's speed; they do on the "
        "Python, numpy and OpenBLAS builds.",
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
            "the same walk's with the mode off, which reads the same named requests and "
            "their accepts).",
        ]
    if hooks:
        lines += ["", *render_hooks(hooks)]
    return "\n".join(lines)


def render_hooks(hooks: Sequence[HookRow]) -> list[str]:
    """The hook's counts, and the change from the first row (the baseline) to the last."""
    lines = [
        "### The plugin's hook on the engine's thread",
        "",
        "`benchmarks/hook_cost.py`'s driver stepping the plugin's controller as the scheduler "
        "hook does (`decide`, the per-request γ, `end_step`; a batch of 32, its requests named "
        "while the policy reads per-request signals, as the default does; decision tables) "
        "against a real sidecar process (this tree's, a fresh one for each run), the "
        f"client's tables aging on the walk's own clock ({STEP_S * 1000:.0f} ms a step) and "
        "each forward pass lasting until a refresh under way is answered, as an engine's "
        f"step outlasts the round trip: run for {HOOK_SHORT:,} and {HOOK_LONG:,} steps after a "
        f"{HOOK_WARM:,}-step warm-up, the difference over the {HOOK_LONG - HOOK_SHORT:,} "
        "steps between, each thread counted apart. The engine's thread is the hook (and the "
        "driver's loop); the client's other threads (its sender, gRPC's) run beside the "
        "engine's. Without the scheduler's per-request walks, which need vLLM: they are "
        "counted apart, below, where vLLM is installed.",
        "",
        "| code | engine thread, instructions per step | client's other threads, per step "
        "| table misses / fallbacks in the steps between |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {h.label} | {h.engine:,.0f} | {h.others:,.0f} | {h.misses} / {h.fallbacks} |"
        for h in hooks
    ]
    if len(hooks) > 1:
        before, after = hooks[0], hooks[-1]
        change = 1 - after.engine / before.engine
        lines += [
            "",
            f"The engine thread's hook: {before.engine:,.0f} → {after.engine:,.0f} instructions "
            f"a step ({change:.0%} fewer than at {before.label}).",
        ]
    walked = [h for h in hooks if h.walks]
    if walked:
        lines += ["", *render_walks(walked)]
    return lines


def render_walks(hooks: Sequence[HookRow]) -> list[str]:
    """The scheduler walks' counts by batch size, and the whole hook at the driver's."""
    sizes = [size for size, _ in hooks[0].walks]
    lines = [
        "#### The scheduler's per-request walks",
        "",
        "`batch_shape` and `verified_step` (`vllm_client_patch/scheduler.py`) on vLLM's own "
        "objects (`benchmarks/scheduler_walks.py`): a decode batch of real `Request`s, each "
        "verifying its drafts and accepting half of them, its `SchedulerOutput` and "
        "`ModelRunnerOutput`, the requests named; walked for "
        f"{WALK_SHORT:,} and {WALK_LONG:,} steps in one process (callgrind's instrumentation "
        "switched on after vLLM's imports, a dump after each walk), the difference over the "
        f"{WALK_LONG - WALK_SHORT:,} steps between. The hook at a batch of {BATCH} is the "
        "controller's row above plus the walks' at that batch.",
        "",
        "| code | " + " | ".join(f"walks, batch {size}" for size in sizes) + " | hook and walks, "
        f"batch {BATCH} |",
        "|---|" + "---:|" * (len(sizes) + 1),
    ]
    for h in hooks:
        walks = dict(h.walks)
        whole = f"{h.engine + walks[BATCH]:,.0f}" if BATCH in walks else "–"
        counts = " | ".join(f"{walks[size]:,.0f}" for size in sizes)
        lines.append(f"| {h.label} | {counts} | {whole} |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-instructions", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"))
    parser.add_argument(
        "--refreshes", type=int, nargs="+", default=list(TABLE_REFRESHES), metavar="STEPS"
    )
    parser.add_argument(
        "--baseline", metavar="REV", help="count the hook at this commit too (before a change)"
    )
    parser.add_argument(
        "--hook-only", action="store_true", help="count the hook only; print it, write nothing"
    )
    parser.add_argument(
        "--walks-only",
        action="store_true",
        help="count the scheduler's walks only (and at --baseline); print them, write nothing",
    )
    parser.add_argument("--walk", type=int, help=argparse.SUPPRESS)  # the counted processes
    parser.add_argument("--hook", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--walks", type=int, nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument(
        "--kind", choices=[k.name for k in TableWalk], default="BATCH", help=argparse.SUPPRESS
    )
    parser.add_argument("--inputs-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.walk is not None:
        walk(args.walk, args.refreshes[0], TableWalk[args.kind], args.inputs_only)
        return 0
    if args.hook is not None:
        hook_walk(args.hook, args.target)
        return 0
    if args.walks is not None:
        scheduler_walks(args.walks)
        return 0
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not installed (Debian: apt-get install valgrind)")
    version = subprocess.run(
        ["valgrind", "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if args.walks_only:
        print("\n".join(walks_lines(args.baseline)))
        return 0
    hooks = hook_rows(args.baseline)
    if args.hook_only:
        print("\n".join(render_hooks(hooks)))
        return 0
    rows = []
    for refresh, kind in table_walks(args.refreshes):
        print(f"refresh every {refresh} steps, {kind.name} walk ...", file=sys.stderr)
        rows.append((refresh, kind, walk_step(refresh, kind)))
    text = render(rows, version, hooks)
    write_section(args.out, SECTION, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
