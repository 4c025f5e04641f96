"""`make bench`: policies × workloads × profiles × seeds in the serving simulator.

Writes its section of docs/BENCHMARKS.md with, per cell, throughput, mean/p99
end-to-end latency, mean TPOT, the ratio of throughput to the oracle's and the
cumulative regret against it, averaged over seeds; a throughput-vs-QPS sweep; and PNG
plots (throughput and latency vs QPS, γ over time with the batch size, throughput and
cumulative regret over time on the trace, the fitted step-time curves). `--quick` runs
a reduced matrix for CI smoke tests. A second section (benchmarks/sim_mixed.py) replays
two workloads with a mixed population, per-sequence γ (`dsde`) beside the batch-γ
policies; `--mixed-only` runs and writes that section alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import nightjar_data

from benchmarks import sim_mixed
from benchmarks.report import write_section
from policy_server.sim.engine import SimResult
from policy_server.sim.profile import HardwareProfile, builtin_profiles, calibration_points
from policy_server.sim.runs import (
    DATA_HELP,
    DEFAULT,
    DRIFT_QPS,
    GAMMA_MAX,
    PLOTTED,
    SLO_MS,
    SLO_ONLY,
    SLO_POLICIES,
    BenchConfig,
    Cell,
    ProfileAssets,
    attainment,
    simulate,
    summarise,
    workloads,
)
from policy_server.sim.workload import (
    RatePhase,
    RequestSpec,
    read_trace,
    synthetic,
)

SECTION = "bench-sim"


def sweep_rates(quick: bool) -> list[float]:
    return [8.0] if quick else [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-sim", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"))
    parser.add_argument(
        "--plots", type=Path, default=Path("docs/img"), help="directory for the PNG figures"
    )
    parser.add_argument("--data", type=Path, default=nightjar_data.ROOT, help=DATA_HELP)
    parser.add_argument("--quick", action="store_true", help="reduced matrix (< 2 min)")
    parser.add_argument(
        "--no-chunked-prefill",
        dest="chunked_prefill",
        action="store_false",
        help="prefill whole prompts in one step (vLLM without chunked prefill)",
    )
    parser.add_argument(
        "--mixed-only",
        action="store_true",
        help="only the mixed-population section (its homogeneous cells run here too)",
    )
    args = parser.parse_args(argv)
    profiles = builtin_profiles(args.data / "calibration")
    with tempfile.TemporaryDirectory(prefix="nightjar-bench-") as scratch:
        assets = {
            name: ProfileAssets.build(profile, Path(scratch)) for name, profile in profiles.items()
        }
        seeds = [1] if args.quick else [1, 2, 3]
        config = BenchConfig(
            args.data,
            seeds,
            args.quick,
            chunked_prefill=args.chunked_prefill,
            assets=assets,
        )
        run(args, config, profiles)
    return 0


def run(
    args: argparse.Namespace, config: BenchConfig, profiles: dict[str, HardwareProfile]
) -> None:
    per_seed = {seed: workloads(args.data, seed, args.quick) for seed in config.seeds}
    names = list(per_seed[config.seeds[0]])
    rates = sweep_rates(args.quick)
    # Imported here, like matplotlib: `nightjar-sim` works without the `sim` extra.
    from tqdm import tqdm

    slo_runs = len(config.slo_workloads) * len(SLO_ONLY) * len(config.seeds)
    matrix_runs = len(profiles) * (
        len(names) * len(config.policies) * len(config.seeds)
        + slo_runs
        + len(rates) * len(config.sweep_policies)
    )
    mixed_jobs = sim_mixed.jobs(() if args.mixed_only else config.policies)
    progress = tqdm(
        total=(0 if args.mixed_only else matrix_runs)
        + len(profiles) * len(mixed_jobs) * len(config.seeds),
        unit="run",
        desc="bench-sim",
    )

    def tick(what: str) -> None:
        progress.set_postfix_str(what)
        progress.update()

    cells: dict[tuple[str, str, str], list[Cell]] = {}
    if not args.mixed_only:
        run_matrix(args, config, profiles, per_seed, cells, tick)
    sim_mixed.run_cells(profiles, per_seed, config, mixed_jobs, cells, tick)
    progress.close()
    write_section(
        args.out,
        sim_mixed.SECTION,
        sim_mixed.render(cells, list(profiles), config, command_of(args)),
    )


def command_of(args: argparse.Namespace) -> str:
    """The command that wrote the figures, as the report names it."""
    if not args.mixed_only:
        command = "make bench-quick" if args.quick else "make bench"
        return command + ("" if args.chunked_prefill else " --no-chunked-prefill")
    flags = [
        "--mixed-only",
        *(["--quick"] if args.quick else []),
        *([] if args.chunked_prefill else ["--no-chunked-prefill"]),
    ]
    return " ".join(["python -m benchmarks.sim_matrix", *flags])


def run_matrix(
    args: argparse.Namespace,
    config: BenchConfig,
    profiles: dict[str, HardwareProfile],
    per_seed: dict[int, dict[str, list[RequestSpec]]],
    cells: dict[tuple[str, str, str], list[Cell]],
    tick: Callable[[str], None],
) -> None:
    """The matrix, the sweep and the plots: the main section, its cells kept in ``cells``."""
    names = list(per_seed[config.seeds[0]])
    kept: dict[tuple[str, str, str], SimResult] = {}  # first seed's runs, for the plots
    for profile_name, profile in profiles.items():
        for workload in names:
            slo = workload in config.slo_workloads
            for policy in [*config.policies, *(SLO_ONLY if slo else ())]:
                for seed in config.seeds:
                    result = simulate(
                        profile, per_seed[seed][workload], policy, config, seed, workload
                    )
                    cell = summarise(profile_name, workload, policy, result)
                    if slo:
                        cell = dataclasses.replace(
                            cell, slo_attainment=attainment(result, SLO_MS[profile_name])
                        )
                    cells.setdefault((profile_name, workload, policy), []).append(cell)
                    if seed == config.seeds[0] and workload in ("step", "azure-conv"):
                        kept[(profile_name, workload, policy)] = result
                    tick(f"{profile_name} {workload} {policy} seed {seed}")

    sweep = run_sweep(profiles, sweep_rates(args.quick), config, tick, args.data)
    figures = write_plots(args.plots, profiles, kept, sweep, args.data)
    write_section(
        args.out,
        SECTION,
        render(cells, list(profiles), names, config, sweep, figures, args.out.parent),
    )
    print(f"report: {args.out}; plots: {', '.join(str(f) for f in figures)}", file=sys.stderr)


Sweep = dict[str, dict[str, list[tuple[float, float, float]]]]


def run_sweep(
    profiles: dict[str, HardwareProfile],
    rates: list[float],
    config: BenchConfig,
    tick: Callable[[str], None],
    data: Path,
) -> Sweep:
    """Throughput and mean latency against a Poisson offered load, first seed."""
    trace = read_trace(data / "traces" / "azure_llm_2023_conv.csv")
    seconds = 30.0 if config.quick else 60.0
    seed = config.seeds[0]
    sweep: Sweep = {}
    for profile_name, profile in profiles.items():
        for rate in rates:
            specs = synthetic([RatePhase(seconds, rate)], trace, seed)
            for policy in config.sweep_policies:
                result = simulate(profile, specs, policy, config, seed)
                sweep.setdefault(profile_name, {}).setdefault(policy, []).append(
                    (rate, result.throughput, statistics.fmean(result.latencies()))
                )
                tick(f"sweep {profile_name} {rate:g} qps {policy}")
    return sweep


def write_plots(
    directory: Path,
    profiles: dict[str, HardwareProfile],
    kept: dict[tuple[str, str, str], SimResult],
    sweep: Sweep,
    data: Path,
) -> list[Path]:
    # Imported here so the report logic (and its tests) do not need matplotlib.
    from policy_server.sim import plots

    figures = [
        plots.plot_profiles(
            profiles, calibration_points(data / "calibration"), directory / "sim_profiles.png"
        ),
        plots.plot_qps_sweep(sweep, directory / "sim_qps_sweep.png"),
    ]
    for profile in profiles:
        step = {p: kept[(profile, "step", p)] for p in (DEFAULT, "nightjar", "ema", "oracle")}
        trace = {p: kept[(profile, "azure-conv", p)] for p in PLOTTED}
        figures += [
            plots.plot_gamma_timeline(
                step,
                directory / f"sim_gamma_{profile}.png",
                f"{profile}, step workload (1 → 8 req/s)",
            ),
            plots.plot_throughput_over_time(
                trace,
                directory / f"sim_throughput_{profile}.png",
                f"{profile}, Azure conv trace at 4 req/s",
            ),
            plots.plot_regret(
                trace,
                directory / f"sim_regret_{profile}.png",
                f"{profile}, Azure conv trace: regret against the oracle",
            ),
        ]
    return figures


def render(
    cells: dict[tuple[str, str, str], list[Cell]],
    profiles: list[str],
    names: list[str],
    config: BenchConfig,
    sweep: Sweep | None = None,
    figures: Sequence[Path] = (),
    relative_to: Path | None = None,
) -> str:
    command = "make bench-quick" if config.quick else "make bench"
    lines = [
        "## Serving simulator: policies on traces (`make bench`)",
        "",
        f"Simulated {datetime.date.today().isoformat()} by `{command}` "
        f"(`benchmarks/sim_matrix.py`), seeds {config.seeds}, acceptance model `chat-sps` "
        f"(α ≈ 0.58, Spec-Bench SpS), Γmax = {GAMMA_MAX}, chunked prefill "
        f"{'on' if config.chunked_prefill else 'off'}. Step times come from vidur profiles "
        "(docs/SIMULATOR.md). Throughput = generated tokens / makespan; at loads the engine "
        "sustains it equals the offered load, so latency separates the policies there. "
        "`vs oracle` = throughput / oracle throughput; `regret` = expected tokens lost "
        "against the per-step oracle's choice, summed over the run, as % of the tokens "
        "generated. `goodput` (the default) and `nightjar` run their defaults with the "
        "profile's c_prefill table; `nightjar-pow2` is Nightjar with `batch_bucketing: pow2`; "
        "`dsd` gets a linear latency model fitted offline once to the profile's decode steps "
        "(B 1–256, γ 0–4, 1,000 context tokens per request); `ucb` is BanditSpec's UCB per "
        "power-of-two batch bucket; `dsde` (DSDE) answers a γ per request from its recent "
        "accepts (no KL divergence in the simulator) under a batch cap. Workloads: "
        "`low`/`high`/`step`/`burst` are Poisson schedules with Azure conv lengths; "
        f"`azure-conv` is 10 minutes of the real trace at 4 req/s; `drift` is {DRIFT_QPS:g} "
        "req/s whose requests switch half-way from α = 0.8 to α = 0.3; `long` is the first "
        "30 minutes of the trace at 4 req/s.",
        "",
    ]
    lines += cell_tables(cells, profiles, names, config.policies)
    lines += targets(cells, profiles, names, config)
    lines += slo_table(cells, profiles, names, config)
    if sweep:
        lines += sweep_table(sweep)
    if figures:
        lines += ["### Figures", ""]
        for figure in figures:
            link = figure.relative_to(relative_to) if relative_to else figure
            lines.append(f"![{figure.stem}]({link.as_posix()})")
        lines.append("")
    return "\n".join(lines)


def cell_tables(
    cells: dict[tuple[str, str, str], list[Cell]],
    profiles: list[str],
    names: list[str],
    policies: list[str],
) -> list[str]:
    """One table per (profile, workload): every policy, means over seeds."""

    def avg(key: tuple[str, str, str], field: str) -> float:
        return statistics.fmean(getattr(c, field) for c in cells[key])

    lines: list[str] = []
    for profile in profiles:
        for workload in names:
            lines += [
                f"### {profile} — {workload}",
                "",
                "| policy | tok/s | vs oracle | mean e2e s | p99 e2e s | mean TPOT ms | regret % |",
                "|---|---:|---:|---:|---:|---:|---:|",
            ]
            oracle = avg((profile, workload, "oracle"), "throughput")
            for policy in policies:
                key = (profile, workload, policy)
                generated = avg(key, "generated_tokens")
                regret = 100 * avg(key, "regret_tokens") / generated if generated else 0.0
                lines.append(
                    f"| {policy} | {avg(key, 'throughput'):.0f} | "
                    f"{avg(key, 'throughput') / oracle:.3f} | {avg(key, 'mean_latency'):.2f} | "
                    f"{avg(key, 'p99_latency'):.2f} | {avg(key, 'mean_tpot_ms'):.1f} | "
                    f"{regret:.2f} |"
                )
            lines.append("")
    return lines


def sweep_table(sweep: Sweep) -> list[str]:
    lines = ["### Throughput vs offered load (Poisson, Azure conv lengths, first seed)", ""]
    for profile, by_policy in sweep.items():
        rates = [p[0] for p in next(iter(by_policy.values()))]
        lines += [
            f"{profile}: tok/s (mean e2e s)",
            "",
            "| policy | " + " | ".join(f"{r:g} qps" for r in rates) + " |",
            "|---|" + "---:|" * len(rates),
        ]
        for policy, points in by_policy.items():
            lines.append(
                f"| {policy} | " + " | ".join(f"{t:.0f} ({lat:.1f})" for _, t, lat in points) + " |"
            )
        lines.append("")
    return lines


def targets(
    cells: dict[tuple[str, str, str], list[Cell]],
    profiles: list[str],
    names: list[str],
    config: BenchConfig,
) -> list[str]:
    """Issue 11's targets per cell for the default policy, from the mean over seeds."""

    def avg(profile: str, workload: str, policy: str, field: str = "throughput") -> float:
        return statistics.fmean(getattr(c, field) for c in cells[(profile, workload, policy)])

    lines = [
        f"### `{DEFAULT}` (the default) against the targets",
        "",
        "Throughput targets per cell: ≥ 0.98 × oracle, ≥ 0.99 × the best fixed γ (off, "
        "static-1…4), ≥ 0.99 × off, ≥ ema, ≥ table. Where the engine keeps up with the "
        "offered load every policy has the same throughput, so the mean end-to-end latency "
        "is shown against the lowest of the other policies (oracle excluded) as well.",
        "",
        f"| profile | workload | {DEFAULT} / oracle | ≥ 0.98 oracle | ≥ 0.99 best fixed "
        "| ≥ 0.99 off | ≥ ema | ≥ table | mean e2e s | lowest other (policy) |",
        "|---|---|---:|---|---|---|---|---|---:|---|",
    ]
    for profile in profiles:
        for workload in names:
            mine = avg(profile, workload, DEFAULT)
            best_fixed = max(avg(profile, workload, p) for p in config.fixed)
            marks = [
                mine >= 0.98 * avg(profile, workload, "oracle"),
                mine >= 0.99 * best_fixed,
                mine >= 0.99 * avg(profile, workload, "off"),
                mine >= avg(profile, workload, "ema"),
                mine >= avg(profile, workload, "table"),
            ]
            others = [p for p in config.policies if p not in (DEFAULT, "oracle")]
            rival = min(others, key=lambda p: avg(profile, workload, p, "mean_latency"))
            latency = avg(profile, workload, DEFAULT, "mean_latency")
            rival_latency = avg(profile, workload, rival, "mean_latency")
            flag = "" if latency <= rival_latency else " **lower**"
            lines.append(
                f"| {profile} | {workload} | {mine / avg(profile, workload, 'oracle'):.3f} | "
                + " | ".join("yes" if ok else "**no**" for ok in marks)
                + f" | {latency:.2f} | {rival_latency:.2f} ({rival}){flag} |"
            )
    lines.append("")
    return lines


def slo_table(
    cells: dict[tuple[str, str, str], list[Cell]],
    profiles: list[str],
    names: list[str],
    config: BenchConfig,
) -> list[str]:
    """TPOT-SLO attainment of the SLO workloads (mean over seeds)."""
    lines = [
        "### TPOT SLO mode (`goodput` with `tpot_slo_ms`)",
        "",
        "Share of requests whose TPOT met the SLO, and throughput; `goodput-slo` runs "
        "the default policy with `tpot_slo_ms` set to the SLO.",
        "",
    ]
    for profile in profiles:
        for workload in (w for w in config.slo_workloads if w in names):
            lines += [
                f"{profile} — {workload}, SLO {SLO_MS[profile]:g} ms",
                "",
                "| policy | SLO attainment | tok/s | mean TPOT ms |",
                "|---|---:|---:|---:|",
            ]
            for policy in SLO_POLICIES:
                runs = cells.get((profile, workload, policy))
                if not runs:
                    continue
                lines.append(
                    f"| {policy} | {statistics.fmean(c.slo_attainment for c in runs):.1%} | "
                    f"{statistics.fmean(c.throughput for c in runs):.0f} | "
                    f"{statistics.fmean(c.mean_tpot_ms for c in runs):.1f} |"
                )
            lines.append("")
    return lines


if __name__ == "__main__":
    sys.exit(main())
