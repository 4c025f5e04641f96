"""`make bench`: policies × workloads × profiles × seeds in the serving simulator.

Writes its section of docs/BENCHMARKS.md (between markers) with, per cell,
throughput, mean/p99 end-to-end latency, mean TPOT and the ratio of throughput to
the oracle's, averaged over seeds. `--quick` runs a reduced matrix for CI smoke tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from policy_server.report import write_section
from policy_server.sim.acceptance import WORKLOADS
from policy_server.sim.engine import DecisionSource, SimConfig, Simulator
from policy_server.sim.profile import builtin_profiles
from policy_server.sim.sources import OracleSource, PolicySource
from policy_server.sim.workload import (
    SCHEDULES,
    RequestSpec,
    read_trace,
    scale_to_qps,
    synthetic,
    window,
)

SECTION = "bench-sim"
GAMMA_MAX = 4


def _static(gamma: int) -> Callable[[int], DecisionSource]:
    return lambda seed: PolicySource.named("static", {"gamma": gamma})


POLICIES: dict[str, Callable[[int], DecisionSource]] = {
    "nightjar": lambda seed: PolicySource.named("nightjar", {"seed": seed, "gamma_max": GAMMA_MAX}),
    "off": lambda seed: PolicySource.named("off"),
    **{f"static-{g}": _static(g) for g in range(1, GAMMA_MAX + 1)},
    "table": lambda seed: PolicySource.named("table"),
    "ema": lambda seed: PolicySource.named("ema", {"gamma_max": GAMMA_MAX}),
    "oracle": lambda seed: OracleSource(),
}


@dataclasses.dataclass(frozen=True)
class Cell:
    profile: str
    workload: str
    policy: str
    throughput: float
    mean_latency: float
    p99_latency: float
    mean_tpot_ms: float


def workloads(data: Path, seed: int, quick: bool) -> dict[str, list[RequestSpec]]:
    trace = read_trace(data / "traces" / "azure_llm_2023_conv.csv")
    scale = 0.5 if quick else 1.0
    out = {
        name: synthetic([dataclasses.replace(p, seconds=p.seconds * scale) for p in phases],
                        trace, seed)
        for name, phases in SCHEDULES.items()
    }  # fmt: skip
    # A slice of the real trace at its own burstiness, rescaled to 4 req/s.
    out["azure-conv"] = scale_to_qps(window(trace, 0, 600 * scale), 4.0)
    return out


def run_cell(profile: str, specs: list[RequestSpec], policy: str, seed: int, data: Path) -> Cell:
    profiles = builtin_profiles(data / "calibration")
    source = POLICIES[policy](seed)
    result = Simulator(
        profiles[profile], WORKLOADS["chat-sps"], specs, source,
        SimConfig(seed=seed, gamma_max=GAMMA_MAX),
    ).run()  # fmt: skip
    lat = result.latencies()
    return Cell(
        profile, "", policy, result.throughput, statistics.fmean(lat),
        lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1000 * statistics.fmean(result.tpots()),
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-sim", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"))
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--quick", action="store_true", help="reduced matrix (< 2 min)")
    args = parser.parse_args(argv)
    seeds = [1] if args.quick else [1, 2, 3]
    profiles = list(builtin_profiles(args.data / "calibration"))
    per_seed = {seed: workloads(args.data, seed, args.quick) for seed in seeds}
    names = list(per_seed[seeds[0]])
    total = len(profiles) * len(names) * len(POLICIES) * len(seeds)
    done, started = 0, time.time()
    cells: dict[tuple[str, str, str], list[Cell]] = {}
    for profile in profiles:
        for workload in names:
            for policy in POLICIES:
                for seed in seeds:
                    cell = run_cell(profile, per_seed[seed][workload], policy, seed, args.data)
                    cells.setdefault((profile, workload, policy), []).append(cell)
                    done += 1
                    print(f"\r[{done}/{total}] {profile} {workload} {policy} "
                          f"{time.time() - started:.0f}s", end="", file=sys.stderr)  # fmt: skip
    print(file=sys.stderr)
    write_section(args.out, SECTION, render(cells, profiles, names, seeds, args.quick))
    return 0


def render(
    cells: dict[tuple[str, str, str], list[Cell]],
    profiles: list[str], names: list[str], seeds: list[int], quick: bool,
) -> str:  # fmt: skip
    def avg(key: tuple[str, str, str], field: str) -> float:
        return statistics.fmean(getattr(c, field) for c in cells[key])

    lines = [
        "## Serving simulator: policies on traces (`make bench`)",
        "",
        f"Simulated {datetime.date.today().isoformat()} by `make bench"
        f"{' --quick' if quick else ''}` (`policy_server/sim/bench.py`), seeds {seeds}, "
        "acceptance model `chat-sps` (α ≈ 0.58, Spec-Bench SpS), Γmax = 4. Step times come "
        "from vidur profiles (see docs/SIMULATOR.md). Throughput = generated tokens / makespan; "
        "at loads the engine sustains it equals the offered load, so latency separates the "
        "policies there. `vs oracle` = throughput / oracle throughput.",
        "",
    ]
    for profile in profiles:
        for workload in names:
            lines += [f"### {profile} — {workload}", "",
                      "| policy | tok/s | vs oracle | mean e2e s | p99 e2e s | mean TPOT ms |",
                      "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
            oracle = avg((profile, workload, "oracle"), "throughput")
            for policy in POLICIES:
                key = (profile, workload, policy)
                lines.append(
                    f"| {policy} | {avg(key, 'throughput'):.0f} | "
                    f"{avg(key, 'throughput') / oracle:.3f} | {avg(key, 'mean_latency'):.2f} | "
                    f"{avg(key, 'p99_latency'):.2f} | {avg(key, 'mean_tpot_ms'):.1f} |"
                )
            lines.append("")
    lines += targets(cells, profiles, names)
    return "\n".join(lines) + "\n"


def targets(
    cells: dict[tuple[str, str, str], list[Cell]], profiles: list[str], names: list[str]
) -> list[str]:
    """Issue 3's targets per cell: Nightjar vs best fixed γ, EMA, table and 0.95 × oracle."""

    def tput(profile: str, workload: str, policy: str) -> float:
        return statistics.fmean(c.throughput for c in cells[(profile, workload, policy)])

    fixed = ["off"] + [p for p in POLICIES if p.startswith("static-")]
    lines = [
        "### Nightjar against the targets (throughput, mean over seeds)",
        "",
        "| profile | workload | nightjar / oracle | ≥ 0.95 oracle | ≥ best fixed γ | ≥ ema "
        "| ≥ table |",
        "|---|---|---:|---|---|---|---|",
    ]
    for profile in profiles:
        for workload in names:
            nj = tput(profile, workload, "nightjar")
            oracle = tput(profile, workload, "oracle")
            best = max(tput(profile, workload, p) for p in fixed)
            marks = [
                nj >= 0.95 * oracle,
                nj >= best,
                nj >= tput(profile, workload, "ema"),
                nj >= tput(profile, workload, "table"),
            ]
            cells_text = " | ".join("yes" if ok else "**no**" for ok in marks)
            lines.append(f"| {profile} | {workload} | {nj / oracle:.3f} | {cells_text} |")
    lines.append("")
    return lines


if __name__ == "__main__":
    sys.exit(main())
