"""`make bench-load` / `make soak`: many engine processes on one real sidecar.

N engine processes, each pacing R steps/s for a duration (default 10 min), drive a
`nightjar-server` process started here (Unix socket by default, or loopback TCP). Each
engine uses the plugin's client (`NightjarClient`, default 2 ms deadline, one stream) as
the plugin does: γ from the held decision table, a new table asked for when it is due, for
a step context whose batch grows and shrinks as simulated requests join and finish, and an
outcome consistent with the γ it ran reported in the next batch.

`--preset` names the shapes of load: `pod` (1 engine × 200 steps/s), `node` (8 engines ×
125 steps/s: one node of 8 GPUs, 8 ms steps), `node-fast` (the same node at 2 ms steps:
8 × 500 steps/s) and `stress` (8 × 1,000 steps/s; the default); explicit flags override a
preset's values.

Then the same load (engines, rate, duration, transport, deadline) against a
bare stream server (`benchmarks/bare_server.py`: the same wire contract, answers γ = 1,
no work), so that every run reports the sidecar's CPU per engine step beside the bare
server's and their ratio. Reported: steps/s achieved, the engines' time to get γ
p50/p99/p999, fallbacks by reason, errors, the server's CPU (user + sys, from /proc of its
pid) per engine step (the engines' own step counts, answered or fallen back) and its RSS at
start and end. `--max-rate` adds a phase with unpaced engines (and its bare twin) that
measures the most steps one sidecar serves, per second and per second of its own CPU.
`--soak` swaps the policy and takes a snapshot periodically (through the admin RPC, with a
token), and checks each snapshot file can be read and loaded into its policy.

Writes the shape's subsection of docs/BENCHMARKS.md's bench-load section (or the soak
section) and a reliability record (docs/reliability/load.json, one per shape, or
soak.json); prints the raw figures as JSON.

This module drives a run and is the command line; the engine processes and the presets are
in `benchmarks/load_engines.py`, the sidecar's process, /proc sampling and soak admin calls
in `benchmarks/load_sidecar.py`, the figures, verdicts and sections in
`benchmarks/load_report.py`.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import logging
import math
import multiprocessing
import os
import queue
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.host import machine
from benchmarks.load_engines import (
    MAX_ERROR_TEXTS,
    PRESETS,
    EngineJob,
    EngineResult,
    LoadConfig,
    engine_entry,
)
from benchmarks.load_report import (
    LoadResult,
    describe,
    load_verdicts,
    merge_records,
    record_name,
    reliability_record,
    render_load,
    render_soak,
    soak_verdicts,
    summary_figure,
    write_load_section,
)
from benchmarks.load_sidecar import (
    AdminEvent,
    ProcSample,
    Sidecar,
    sample_process,
    sidecar,
    snapshot_and_check,
    swap,
    swap_plan,
)
from benchmarks.report import percentile, write_section

SAMPLE_EVERY_S = 1.0


# -- a run ----------------------------------------------------------------------------------


def run_load(config: LoadConfig, progress_bar: bool = True) -> LoadResult:
    """Start a sidecar and the engines, run for the configured time, and collect."""
    with (
        tempfile.TemporaryDirectory(prefix="nj-load-") as tmp,
        sidecar(config.transport, Path(tmp), config.server) as server,
    ):
        return _drive(config, server, progress_bar)


def _drive(config: LoadConfig, server: Sidecar, progress_bar: bool) -> LoadResult:
    ctx = multiprocessing.get_context("spawn")
    results_queue: multiprocessing.Queue[EngineResult] = ctx.Queue()
    counters = [ctx.Value("q", 0, lock=False) for _ in range(config.engines)]
    # Spawned engines import the client and connect first; the clock starts for all at once.
    spawn_allowance = 5.0 + 1.5 * config.engines / max(1, os.cpu_count() or 1)
    start_at = time.time() + spawn_allowance
    end_at = start_at + config.duration_s
    engines = [
        ctx.Process(
            target=engine_entry,
            name=f"load-engine-{i}",
            args=(
                EngineJob(i, server.target, config, start_at, end_at),
                counters[i],
                results_queue,
            ),
        )
        for i in range(config.engines)
    ]
    for engine in engines:
        engine.start()
    decisions_before = server.decisions_total()
    started_iso = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    time.sleep(max(0.0, start_at - time.time()))
    t0 = time.time()
    samples = [sample_process(server.pid, 0.0)]
    warm: ProcSample | None = None
    events: list[AdminEvent] = []
    next_swap = config.swap_every_s or math.inf
    # Snapshots half a period after swaps, so each sees a policy that has served a while.
    next_snapshot = config.snapshot_every_s / 2 if config.snapshot_every_s else math.inf
    swaps = 0
    plan = swap_plan(server.starting_policy) if config.swap_every_s else []
    expected = config.engines * config.rate * config.duration_s if config.rate else None
    bar = _progress(expected, config, enabled=progress_bar)
    try:
        while (elapsed := time.time() - t0) < config.duration_s:
            time.sleep(min(SAMPLE_EVERY_S, max(0.0, config.duration_s - elapsed)))
            elapsed = time.time() - t0
            if all(not e.is_alive() for e in engines):
                break
            samples.append(sample_process(server.pid, elapsed))
            if warm is None and elapsed >= config.warmup_s:
                warm = samples[-1]
            if elapsed >= next_swap:
                events.append(dataclasses.replace(swap(server, swaps, plan), at_s=elapsed))
                swaps += 1
                next_swap += config.swap_every_s
            if elapsed >= next_snapshot:
                events.append(dataclasses.replace(snapshot_and_check(server), at_s=elapsed))
                next_snapshot += config.snapshot_every_s
            done = sum(int(c.value) for c in counters)
            bar.n = done
            rss = samples[-1].rss_bytes / 2**20
            bar.set_postfix(rate=f"{done / elapsed:,.0f}/s", rss=f"{rss:.0f}MiB", refresh=False)
            bar.refresh()
        results = _engine_results(results_queue, len(engines))
    finally:
        bar.close()
        for engine in engines:
            engine.join(timeout=30)
            if engine.is_alive():
                engine.kill()
    end = sample_process(server.pid, time.time() - t0)
    samples.append(end)
    server_decisions = server.decisions_total() - decisions_before
    return _collect(
        config, started_iso, results, samples, warm or end, server, server_decisions, events
    )


def _engine_results(results: multiprocessing.Queue[EngineResult], count: int) -> list[EngineResult]:
    """Every engine's result; one that never reports (crashed) is an error."""
    collected: list[EngineResult] = []
    give_up = time.monotonic() + 120
    while len(collected) < count:
        try:
            collected.append(results.get(timeout=max(0.1, give_up - time.monotonic())))
        except queue.Empty:
            lost = EngineResult(f"{count - len(collected)} engine(s)")
            lost.error("exited without a result")
            return [*collected, lost]
    return collected


def _progress(total: float | None, config: LoadConfig, enabled: bool) -> Any:
    from tqdm import tqdm

    label = f"{config.engines} engines × {config.rate:,.0f}/s" if config.rate else "max rate"
    return tqdm(
        total=int(total) if total else None,
        desc=f"{label}, {config.server}",
        unit="step",
        unit_scale=True,
        disable=not enabled,
        file=sys.stderr,
        mininterval=1.0,
    )


def _collect(
    config: LoadConfig,
    started: str,
    results: list[EngineResult],
    samples: list[ProcSample],
    warm: ProcSample,
    server: Sidecar,
    server_decisions: int,
    events: list[AdminEvent],
) -> LoadResult:
    latencies = array("d")
    fallbacks: collections.Counter[str] = collections.Counter()
    error_texts: list[str] = []
    for r in results:
        latencies.frombytes(r.latencies_us)
        fallbacks.update(r.fallbacks)
        error_texts += [f"{r.engine_id}: {t}" for t in r.error_texts]
    errors = sum(r.errors for r in results)
    for event in events:
        if not event.ok:
            errors += 1
            error_texts.append(f"{event.action} at {event.at_s:.0f} s: {event.detail}")
    if server.process.poll() is not None:
        errors += 1
        error_texts.append(f"the sidecar exited with code {server.process.returncode}")
    problems = server.log_problems()
    errors += len(problems)
    error_texts += [f"sidecar log: {line}" for line in problems[:MAX_ERROR_TEXTS]]
    ordered = sorted(latencies)
    elapsed = max((r.elapsed_s for r in results), default=0.0) or config.duration_s
    cpu_s = samples[-1].cpu_s - samples[0].cpu_s
    steps = sum(r.steps for r in results)
    return LoadResult(
        config=dataclasses.asdict(config),
        started=started,
        steps=steps,
        decisions=sum(r.decisions for r in results),
        sidecar_decisions=sum(r.sidecar_decisions for r in results),
        server_decisions=server_decisions,
        decisions_per_s=steps / elapsed,
        elapsed_s=elapsed,
        latency_us={
            name: percentile(ordered, q) if ordered else float("nan")
            for name, q in (("p50", 0.5), ("p99", 0.99), ("p999", 0.999), ("max", 1.0))
        },
        fallbacks=dict(fallbacks),
        late_replies=sum(r.late_replies for r in results),
        table_misses=sum(r.table_misses for r in results),
        skipped_behind=sum(r.skipped_behind for r in results),
        errors=errors,
        error_texts=error_texts[: 4 * MAX_ERROR_TEXTS],
        server_cpu_s=cpu_s,
        server_cpu_percent=100 * cpu_s / max(1e-9, samples[-1].at_s - samples[0].at_s),
        rss_start_bytes=samples[0].rss_bytes,
        rss_warm_bytes=warm.rss_bytes,
        rss_end_bytes=samples[-1].rss_bytes,
        rss_max_bytes=max(s.rss_bytes for s in samples),
        load_average_mean=sum(s.load_average for s in samples) / len(samples),
        load_average_max=max(s.load_average for s in samples),
        admin_events=[dataclasses.asdict(e) for e in events],
        starting_policy=server.starting_policy,
        host_cores=os.cpu_count() or 1,
    )


# -- command line ---------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench-load", description=__doc__.splitlines()[0])
    p.add_argument(
        "--preset",
        choices=tuple(PRESETS),
        default="stress",
        help="the shape of load: "
        + "; ".join(f"{name} = {preset.what}" for name, preset in PRESETS.items())
        + " (default stress; --engines, --rate, --max-rate override it)",
    )
    p.add_argument("--engines", type=int, help="engine processes (default: the preset's)")
    p.add_argument("--rate", type=float, help="steps/s per engine (default: the preset's)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds (default 600)")
    p.add_argument(
        "--quick", action="store_true", help="60 s (a smoke run; --duration still wins when given)"
    )
    p.add_argument("--transport", choices=("uds", "tcp"), default="uds")
    p.add_argument(
        "--deadline-ms",
        type=float,
        default=2.0,
        help="the client's decision deadline (default 2, the plugin's)",
    )
    p.add_argument(
        "--max-rate",
        type=float,
        metavar="SECONDS",
        help="then this long with unpaced engines: the most one sidecar serves "
        "(0 = skip; default 60 for the stress shape, 0 for any other; not in --soak)",
    )
    p.add_argument("--max-rate-engines", type=int, default=4)
    p.add_argument(
        "--baseline",
        type=float,
        metavar="SECONDS",
        help="then this long the same load against a bare stream server that decides "
        "nothing, the stock-gRPC baseline each figure is compared with (default: as long as "
        "the run; 0 = skip)",
    )
    p.add_argument("--soak", action="store_true", help="swap the policy and snapshot periodically")
    p.add_argument("--swap-every", type=float, default=60.0, help="soak: seconds between swaps")
    p.add_argument(
        "--snapshot-every", type=float, default=60.0, help="soak: seconds between snapshots"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"))
    p.add_argument("--reliability-dir", type=Path, default=Path("docs/reliability"))
    p.add_argument("--json", type=Path, help="also write the raw figures here")
    p.add_argument("--note", default="", help="conditions to state in the report")
    p.add_argument("--revision", help="the source revision measured (default: from git)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    given = list(argv if argv is not None else sys.argv[1:])
    if args.quick and not any(a.split("=", 1)[0] == "--duration" for a in given):
        args.duration = 60.0
    preset = PRESETS[args.preset]
    if args.engines is None:
        args.engines = preset.engines
    if args.rate is None:
        args.rate = preset.rate
    if args.max_rate is None:
        # The unpaced phase belongs to a preset's shape, not to one changed by flags.
        shape = LoadConfig(engines=args.engines, rate=args.rate).shape
        args.max_rate = PRESETS[shape].max_rate_s if shape in PRESETS else 0.0
    if args.baseline is None:
        args.baseline = args.duration
    return args


# Where the results go and how they are shown: not part of the measured conditions.
OUTPUT_OPTIONS = {
    "--out": 1,
    "--reliability-dir": 1,
    "--json": 1,
    "--note": 1,
    "--no-progress": 0,
    "--revision": 1,
}


def source_revision() -> str:
    """The commit measured (with "+ local changes" when the checkout differs from it)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit} + local changes" if dirty else commit


def shown_command(argv: list[str]) -> str:
    """The command as the report states it: `make soak` when run as that target."""
    return report.shown_command("benchmarks.load", argv, OUTPUT_OPTIONS, {("--soak",): "make soak"})


def main(argv: Sequence[str] | None = None) -> int:
    # The snapshot check builds policies here; their start-up notes are not the report's.
    # Put the level back after: main also runs inside other processes (the tests).
    policies_log = logging.getLogger("policy_server.policies")
    level = policies_log.level
    policies_log.setLevel(logging.ERROR)
    try:
        return _main(argv)
    finally:
        policies_log.setLevel(level)


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    header = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "command": shown_command(list(argv if argv is not None else sys.argv[1:])),
        "note": args.note,
        "revision": args.revision or source_revision(),
    }
    config = LoadConfig(
        engines=args.engines,
        rate=args.rate,
        duration_s=args.duration,
        transport=args.transport,
        deadline_s=args.deadline_ms / 1000,
        seed=args.seed,
        swap_every_s=args.swap_every if args.soak else 0.0,
        snapshot_every_s=args.snapshot_every if args.soak else 0.0,
    )
    progress = not args.no_progress
    args.reliability_dir.mkdir(parents=True, exist_ok=True)
    raw: dict[str, Any] = {"header": header}

    def bare_twin(measured: LoadConfig, seconds: float) -> LoadResult | None:
        """The same load against the bare stream server (no swaps or snapshots there)."""
        if seconds <= 0:
            return None
        twin = dataclasses.replace(
            measured, server="bare", duration_s=seconds, swap_every_s=0.0, snapshot_every_s=0.0
        )
        return run_load(twin, progress)

    if args.soak:
        soak = run_load(config, progress)
        baseline = bare_twin(config, args.baseline)
        verdicts = soak_verdicts(soak)
        raw["soak"] = soak.figures() | {"verdicts": verdicts}
        if baseline is not None:
            raw["baseline"] = baseline.figures()
        write_section(args.out, "soak", render_soak(soak, header, baseline))
        figure = (
            f"{summary_figure(soak, baseline)}; {sum(s['ok'] for s in soak.snapshots)}/"
            f"{len(soak.snapshots)} snapshots readable"
        )
        record = reliability_record(
            "soak",
            f"{describe(soak)}; policy swap every "
            f"{config.swap_every_s:g} s, snapshot every "
            f"{config.snapshot_every_s:g} s",
            figure,
            verdicts,
            header,
        )
        (args.reliability_dir / "soak.json").write_text(json.dumps(record, indent=2) + "\n")
    else:
        load = run_load(config, progress)
        baseline = bare_twin(config, args.baseline)
        peak = peak_baseline = None
        if args.max_rate > 0:
            peak_config = dataclasses.replace(
                config,
                engines=args.max_rate_engines,
                rate=0.0,
                duration_s=args.max_rate,
            )
            peak = run_load(peak_config, progress)
            peak_baseline = bare_twin(peak_config, args.max_rate if args.baseline > 0 else 0)
        verdicts = load_verdicts(load, baseline)
        raw["load"] = load.figures() | {"verdicts": verdicts}
        for name, run in (
            ("baseline", baseline),
            ("max_rate", peak),
            ("max_rate_baseline", peak_baseline),
        ):
            if run is not None:
                raw[name] = run.figures()
        write_load_section(
            args.out, config.shape, render_load(load, peak, header, baseline, peak_baseline)
        )
        record = reliability_record(
            record_name(config), describe(load), summary_figure(load, baseline), verdicts, header
        )
        path = args.reliability_dir / "load.json"
        records = merge_records(path, record)
        path.write_text(json.dumps(records[0] if len(records) == 1 else records, indent=2) + "\n")
    ok = all(verdicts.values())
    text = json.dumps(raw, indent=2)
    if args.json:
        args.json.write_text(text)
    print(text)
    print("targets met" if ok else "targets NOT met (see the report)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
