"""`make bench-tables`: the default policy asked every step against decision tables.

The question behind docs/DECISION_TABLES.md: when the sidecar decides a table of γ by batch
size every few steps (one posterior draw per table) and the engine runs each step from it,
how much goodput is lost? Every cell of `make bench`'s matrix (both profiles, all its
workloads, seeds 1..N) runs `goodput` per step and through `TableSource` (the protocol's
own service and client code, in process) refreshed every 8, 16 and 32 steps; the
section reports throughput, mean end-to-end latency and regret against the oracle of each,
the differences to per-step, and how many steps a table served.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import nightjar_data

from benchmarks.report import write_section
from policy_server.sim.engine import Simulator
from policy_server.sim.profile import HardwareProfile, builtin_profiles
from policy_server.sim.runs import (
    DATA_HELP,
    GAMMA_MAX,
    BenchConfig,
    Cell,
    ProfileAssets,
    acceptance_of,
    summarise,
    workloads,
)
from policy_server.sim.sources import PolicySource, TableSource
from policy_server.sim.workload import RequestSpec

SECTION = "bench-tables"
REFRESHES = (8, 16, 32)


def run_cell(
    profile: HardwareProfile,
    workload: str,
    specs: list[RequestSpec],
    seed: int,
    config: BenchConfig,
    refresh: int,
) -> tuple[Cell, int, int]:
    """One run of goodput (per step when ``refresh`` is 0): its summary, the steps that
    decided γ and the tables it took."""
    assets = config.assets[profile.name]
    params = {"seed": seed, "gamma_max": GAMMA_MAX, "prefill_cost_table": assets.prefill_cost_table}
    source: PolicySource | TableSource
    if refresh:
        source = TableSource.named("goodput", params, refresh_steps=refresh)
    else:
        source = PolicySource.named("goodput", params)
    acceptance = acceptance_of(workload, specs, config)
    result = Simulator(profile, acceptance, specs, source, config.sim(seed)).run()
    name = f"tables-{refresh}" if refresh else "per step"
    tables = source.refreshes if isinstance(source, TableSource) else 0
    decided = sum(1 for step in result.steps if step.batch_size)
    return summarise(profile.name, workload, name, result), decided, tables


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-tables", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"))
    parser.add_argument("--data", type=Path, default=nightjar_data.ROOT, help=DATA_HELP)
    parser.add_argument("--seeds", type=int, default=3, help="seeds 1..N per cell")
    parser.add_argument("--quick", action="store_true", help="make bench-quick's workloads")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    profiles = builtin_profiles(args.data / "calibration")
    seeds = list(range(1, args.seeds + 1))
    per_seed = {seed: workloads(args.data, seed, args.quick) for seed in seeds}
    rows: list[str] = []
    with tempfile.TemporaryDirectory(prefix="nightjar-bench-tables-") as scratch:
        assets = {name: ProfileAssets.build(p, Path(scratch)) for name, p in profiles.items()}
        config = BenchConfig(args.data, seeds, args.quick, assets=assets)
        for profile in profiles.values():
            for workload in per_seed[seeds[0]]:
                specs = {seed: per_seed[seed][workload] for seed in seeds}
                rows.append(compare(profile, workload, specs, config))
                print(rows[-1], file=sys.stderr, flush=True)
    write_section(args.out, SECTION, render(rows, config))
    return 0


def compare(
    profile: HardwareProfile,
    workload: str,
    specs: dict[int, list[RequestSpec]],
    config: BenchConfig,
) -> str:
    """One table row: per step, then each refresh period, averaged over the seeds."""
    figures = []
    for refresh in (0, *REFRESHES):
        runs = [run_cell(profile, workload, specs[s], s, config, refresh) for s in config.seeds]
        cells = [cell for cell, _, _ in runs]
        steps = sum(decided for _, decided, _ in runs)
        tables = sum(count for _, _, count in runs)
        figures.append(
            (
                statistics.fmean(c.throughput for c in cells),
                statistics.fmean(c.mean_latency for c in cells),
                statistics.fmean(
                    100 * c.regret_tokens / c.generated_tokens if c.generated_tokens else 0.0
                    for c in cells
                ),
                steps / tables if tables else 0.0,
            )
        )
    base = figures[0]
    out = [f"| {profile.name} | `{workload}` | {base[0]:.0f} | {base[1]:.2f} | {base[2]:.2f} |"]
    for throughput, latency, regret, per_table in figures[1:]:
        out.append(
            f" {100 * (throughput / base[0] - 1):+.2f} % | {100 * (latency / base[1] - 1):+.2f} % "
            f"| {regret:.2f} | {per_table:.1f} |"
        )
    return "".join(out)


def render(rows: list[str], config: BenchConfig) -> str:
    periods = " | ".join(
        f"tables-{k} tok/s | tables-{k} mean e2e | tables-{k} regret % | steps per table"
        for k in REFRESHES
    )
    rule = "|---|---|---:|---:|---:|" + "---:|---:|---:|---:|" * len(REFRESHES)
    return "\n".join(
        [
            "## Serving simulator: decisions per step against decision tables "
            "(`make bench-tables`)",
            "",
            f"Simulated {datetime.date.today().isoformat()} by `make bench-tables` "
            f"(`benchmarks/sim_tables.py`), seeds {config.seeds}, "
            f"{'the quick' if config.quick else 'the full'} workloads of `make bench`, the same "
            f"profiles and settings (Γmax = {GAMMA_MAX}, `chat-sps` acceptance, chunked "
            "prefill). `goodput` decides every step (per step), or through decision tables "
            "(nightjar.v1.7, docs/DECISION_TABLES.md) with the protocol's own code in process "
            "(the sidecar's `DecisionService.table_step`, the client's `TableCache`), refreshed "
            f"every {_periods_in_words()} steps, and early when the batch size leaves the table "
            "(the sizes the batch may move to from the refresh's: `TableOptions.sizes`), "
            "the speculation state flips (γ_prev = 0 or > 0), or "
            "a trial entry (a γ never run in its octave) has run once; a drawn exploring "
            "entry's later steps run the greedy γ the table names for them (nightjar.v1.10). "
            "Differences are to per step; regret is the share of generated tokens lost against "
            "the per-step oracle; steps per table is how many steps one refresh served (the "
            "round trips a table saves).",
            "",
            f"| profile | workload | per step tok/s | per step mean e2e s | per step regret % "
            f"| {periods} |",
            rule,
            *rows,
        ]
    )


def _periods_in_words() -> str:
    """REFRESHES as "8, 16 or 32"."""
    *first, last = (str(k) for k in REFRESHES)
    return f"{', '.join(first)} or {last}" if first else last


if __name__ == "__main__":
    raise SystemExit(main())
