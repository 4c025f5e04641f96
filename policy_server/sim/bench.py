"""`make bench`: policies × workloads × profiles × seeds in the serving simulator.

Writes its section of docs/BENCHMARKS.md with, per cell, throughput, mean/p99
end-to-end latency, mean TPOT, the ratio of throughput to the oracle's and the
cumulative regret against it, averaged over seeds; a throughput-vs-QPS sweep; and PNG
plots (throughput and latency vs QPS, γ over time with the batch size, throughput and
cumulative regret over time on the trace, the fitted step-time curves). `--quick` runs
a reduced matrix for CI smoke tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import nightjar_data

from policy_server.policies.dsd import fit_latency
from policy_server.report import write_section
from policy_server.sim.acceptance import WORKLOADS, AcceptanceModel, AcceptanceSchedule
from policy_server.sim.engine import DecisionSource, SimConfig, SimResult, Simulator
from policy_server.sim.profile import HardwareProfile, builtin_profiles, calibration_points
from policy_server.sim.sources import OracleSource, PolicySource
from policy_server.sim.workload import (
    SCHEDULES,
    RatePhase,
    RequestSpec,
    read_trace,
    scale_to_qps,
    synthetic,
    window,
)

if TYPE_CHECKING:
    from tqdm import tqdm

SECTION = "bench-sim"
GAMMA_MAX = 4

# Every --data option reads this layout; the default is the data shipped with the package.
DATA_HELP = "directory with calibration/, traces/ and prompts/ (default: nightjar_data, shipped)"


# TPOT-SLO mode (AdaSpec): per profile, an SLO between the best and the worst mean TPOT
# the fixed policies reach on the step workload; attainment = requests meeting it.
SLO_MS = {"llama2-7b-a100": 40.0, "llama2-70b-h100-tp4": 30.0}


@dataclasses.dataclass(frozen=True)
class ProfileAssets:
    """What an operator measures once per model and hardware before deploying a policy:
    the c_prefill switching-cost table (Nightjar, goodput) and the linear latency model
    SmartSpec/DSD fits offline."""

    prefill_cost_table: str = ""
    dsd_latency: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    # The TPOT SLO the operator runs this deployment with (goodput-slo); 0 = none.
    tpot_slo_ms: float = 0.0

    @classmethod
    def build(cls, profile: HardwareProfile, directory: Path) -> ProfileAssets:
        table = profile.write_prefill_cost_table(directory / f"{profile.name}.c_prefill.csv")
        # DSD's offline profile: decode steps over a grid of batch sizes and γ, with a
        # typical context of 1,000 tokens per request.
        grid = [
            (b, g, 1000 * b, 1000 * profile.step_seconds(b, g, 0, 1000 * b))
            for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)
            for g in range(GAMMA_MAX + 1)
        ]
        return cls(str(table), fit_latency(grid), SLO_MS.get(profile.name, 0.0))


# A factory gets the run's seed and the profile's assets.
SourceFactory = Callable[[int, ProfileAssets], DecisionSource]


def _static(gamma: int) -> SourceFactory:
    return lambda seed, assets: PolicySource.named("static", {"gamma": gamma})


def _learning(policy: str, **params: object) -> SourceFactory:
    # Deployed as their papers run them: with the engine's profiled switching cost.
    return lambda seed, assets: PolicySource.named(policy, {
        "seed": seed, "gamma_max": GAMMA_MAX, "prefill_cost_table": assets.prefill_cost_table,
        **params,
    })  # fmt: skip


POLICIES: dict[str, SourceFactory] = {
    "goodput": _learning("goodput"),
    "nightjar": _learning("nightjar"),
    "nightjar-pow2": _learning("nightjar", batch_bucketing="pow2"),
    "off": lambda seed, assets: PolicySource.named("off"),
    **{f"static-{g}": _static(g) for g in range(1, GAMMA_MAX + 1)},
    "table": lambda seed, assets: PolicySource.named("table"),
    "ema": lambda seed, assets: PolicySource.named("ema", {"gamma_max": GAMMA_MAX}),
    "dsd": lambda seed, assets: PolicySource.named(
        "dsd", {"gamma_max": GAMMA_MAX, **assets.dsd_latency}
    ),
    "ucb": lambda seed, assets: PolicySource.named("ucb", {"gamma_max": GAMMA_MAX}),
    "oracle": lambda seed, assets: OracleSource(),
}
# Only in the SLO table: the default policy with the deployment's TPOT SLO.
SLO_ONLY: dict[str, SourceFactory] = {
    "goodput-slo": lambda seed, assets: PolicySource.named(
        "goodput",
        {
            "seed": seed,
            "gamma_max": GAMMA_MAX,
            "prefill_cost_table": assets.prefill_cost_table,
            "tpot_slo_ms": assets.tpot_slo_ms,
        },
    ),
}
FIXED = ["off"] + [p for p in POLICIES if p.startswith("static-")]
# The policy the targets are judged for: the server's default.
DEFAULT = "goodput"
SWEEP_POLICIES = ["goodput", "nightjar", "off", "static-1", "static-3", "table", "ema", "dsd",
                  "oracle"]  # fmt: skip
# Lines in the over-time plots (all of them would be unreadable).
PLOTTED = ["goodput", "nightjar", "off", "static-1", "ema", "table", "oracle"]
SLO_WORKLOADS = ("step", "azure-conv")
SLO_POLICIES = ["goodput-slo", "goodput", "static-1", "static-2", "table", "ema", "dsd",
                "oracle"]  # fmt: skip
# `make bench-quick` (the CI smoke run): fewer policies, SLO on one workload, one rate.
QUICK_POLICIES = ["goodput", "nightjar", "off", "static-1", "static-3", "table", "ema", "dsd",
                  "oracle"]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Cell:
    profile: str
    workload: str
    policy: str
    throughput: float
    mean_latency: float
    p99_latency: float
    mean_tpot_ms: float
    generated_tokens: int = 0
    regret_tokens: float = 0.0
    # Share of requests whose TPOT met the profile's SLO (SLO workloads only).
    slo_attainment: float = 0.0


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    data: Path
    seeds: list[int]
    quick: bool
    chunked_prefill: bool = True
    acceptance: str = "chat-sps"
    # Profile name -> its assets (written by main into a scratch directory).
    assets: dict[str, ProfileAssets] = dataclasses.field(default_factory=dict)
    # Run only these policies (default: the full matrix, or the quick one).
    only: tuple[str, ...] = ()

    @property
    def policies(self) -> list[str]:
        if self.only:
            return list(self.only)
        return QUICK_POLICIES if self.quick else list(POLICIES)

    @property
    def sweep_policies(self) -> list[str]:
        return [p for p in SWEEP_POLICIES if p in self.policies]

    @property
    def slo_workloads(self) -> tuple[str, ...]:
        return SLO_WORKLOADS[:1] if self.quick else SLO_WORKLOADS

    @property
    def fixed(self) -> list[str]:
        return [p for p in FIXED if p in self.policies]

    @property
    def sim(self) -> Callable[[int], SimConfig]:
        return lambda seed: SimConfig(
            seed=seed, gamma_max=GAMMA_MAX, chunked_prefill=self.chunked_prefill,
            track_regret=True,
        )  # fmt: skip


# The drift workload: the request mix changes half-way from one a draft predicts well
# (α = 0.8, e.g. code edits, EAGLE-class drafts) to one it predicts badly (α = 0.3).
DRIFT_SECONDS = 240.0
DRIFT_QPS = 3.0
DRIFT_PHASES = (
    AcceptanceModel("easy", 0.8, source="drift workload, first half"),
    AcceptanceModel("hard", 0.3, source="drift workload, second half"),
)
# The long workload: the first 30 minutes of the Azure conv trace at 4 req/s.
LONG_SECONDS = 1800.0


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
    out["drift"] = synthetic([RatePhase(DRIFT_SECONDS * scale, DRIFT_QPS)], trace, seed)
    if not quick:
        out["long"] = scale_to_qps(window(trace, 0, LONG_SECONDS), 4.0)
    return out


def acceptance_of(
    workload: str, specs: Sequence[RequestSpec], bench: BenchConfig
) -> AcceptanceModel | AcceptanceSchedule:
    """The request mix of a workload: the bench's model, or the drift schedule."""
    if workload != "drift":
        return WORKLOADS[bench.acceptance]
    half = (specs[-1].arrival_s if specs else 0.0) / 2
    return AcceptanceSchedule(((0.0, DRIFT_PHASES[0]), (half, DRIFT_PHASES[1])))


def simulate(
    profile: HardwareProfile, specs: list[RequestSpec], policy: str, bench: BenchConfig, seed: int,
    workload: str = "",
) -> SimResult:  # fmt: skip
    factory = POLICIES[policy] if policy in POLICIES else SLO_ONLY[policy]
    source = factory(seed, bench.assets.get(profile.name, ProfileAssets()))
    acceptance = acceptance_of(workload, specs, bench)
    return Simulator(profile, acceptance, specs, source, bench.sim(seed)).run()


def summarise(profile: str, workload: str, policy: str, result: SimResult) -> Cell:
    lat = result.latencies()
    return Cell(
        profile, workload, policy, result.throughput, statistics.fmean(lat),
        lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1000 * statistics.fmean(result.tpots()),
        result.generated_tokens, result.regret_tokens,
    )  # fmt: skip


def attainment(result: SimResult, slo_ms: float) -> float:
    """Share of finished requests whose TPOT met ``slo_ms``."""
    tpots = result.tpots()
    return sum(1000 * t <= slo_ms for t in tpots) / len(tpots) if tpots else 0.0


def summary_table(cells: Mapping[str, Cell], reference: str = "oracle") -> list[str]:
    """Plain-text table of one workload's runs, throughput relative to `reference`."""
    base = cells[reference].throughput if reference in cells else 0.0
    lines = [f"{'policy':<20} {'tok/s':>7} {'vs ' + reference:>10} {'mean e2e s':>10} "
             f"{'p99 e2e s':>9} {'TPOT ms':>8} {'regret %':>8}"]  # fmt: skip
    for name, c in cells.items():
        regret = 100 * c.regret_tokens / c.generated_tokens if c.generated_tokens else 0.0
        ratio = f"{c.throughput / base:.3f}" if base else "-"
        lines.append(f"{name:<20} {c.throughput:>7.0f} {ratio:>10} {c.mean_latency:>10.2f} "
                     f"{c.p99_latency:>9.2f} {c.mean_tpot_ms:>8.1f} {regret:>8.2f}")  # fmt: skip
    return lines


def sweep_rates(quick: bool) -> list[float]:
    return [8.0] if quick else [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-sim", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"))
    parser.add_argument("--plots", type=Path, default=Path("docs/img"),
                        help="directory for the PNG figures")  # fmt: skip
    parser.add_argument("--data", type=Path, default=nightjar_data.ROOT, help=DATA_HELP)
    parser.add_argument("--quick", action="store_true", help="reduced matrix (< 2 min)")
    parser.add_argument(
        "--no-chunked-prefill",
        dest="chunked_prefill",
        action="store_false",
        help="prefill whole prompts in one step (vLLM without chunked prefill)",
    )
    args = parser.parse_args(argv)
    profiles = builtin_profiles(args.data / "calibration")
    with tempfile.TemporaryDirectory(prefix="nightjar-bench-") as scratch:
        assets = {
            name: ProfileAssets.build(profile, Path(scratch)) for name, profile in profiles.items()
        }
        seeds = [1] if args.quick else [1, 2, 3]
        config = BenchConfig(
            args.data, seeds, args.quick, chunked_prefill=args.chunked_prefill, assets=assets,
        )  # fmt: skip
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
    progress = tqdm(
        total=len(profiles) * (len(names) * len(config.policies) * len(config.seeds) + slo_runs
                               + len(rates) * len(config.sweep_policies)),
        unit="run", desc="bench-sim",
    )  # fmt: skip

    cells: dict[tuple[str, str, str], list[Cell]] = {}
    kept: dict[tuple[str, str, str], SimResult] = {}  # first seed's runs, for the plots
    for profile_name, profile in profiles.items():
        for workload in names:
            slo = workload in config.slo_workloads
            for policy in [*config.policies, *(SLO_ONLY if slo else ())]:
                for seed in config.seeds:
                    result = simulate(profile, per_seed[seed][workload], policy, config, seed,
                                      workload)  # fmt: skip
                    cell = summarise(profile_name, workload, policy, result)
                    if slo:
                        cell = dataclasses.replace(
                            cell, slo_attainment=attainment(result, SLO_MS[profile_name])
                        )
                    cells.setdefault((profile_name, workload, policy), []).append(cell)
                    if seed == config.seeds[0] and workload in ("step", "azure-conv"):
                        kept[(profile_name, workload, policy)] = result
                    progress.set_postfix_str(f"{profile_name} {workload} {policy} seed {seed}")
                    progress.update()

    sweep = run_sweep(profiles, rates, config, progress, args.data)
    progress.close()
    figures = write_plots(args.plots, profiles, kept, sweep, args.data)
    write_section(args.out, SECTION, render(cells, list(profiles), names, config, sweep, figures,
                                            args.out.parent))  # fmt: skip
    print(f"report: {args.out}; plots: {', '.join(str(f) for f in figures)}", file=sys.stderr)


Sweep = dict[str, dict[str, list[tuple[float, float, float]]]]


def run_sweep(
    profiles: dict[str, HardwareProfile], rates: list[float], config: BenchConfig,
    progress: tqdm[NoReturn], data: Path,
) -> Sweep:  # fmt: skip
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
                progress.set_postfix_str(f"sweep {profile_name} {rate:g} qps {policy}")
                progress.update()
    return sweep


def write_plots(
    directory: Path, profiles: dict[str, HardwareProfile],
    kept: dict[tuple[str, str, str], SimResult], sweep: Sweep, data: Path,
) -> list[Path]:  # fmt: skip
    # Imported here so the report logic (and its tests) do not need matplotlib.
    from policy_server.sim import plots

    figures = [
        plots.plot_profiles(profiles, calibration_points(data / "calibration"),
                            directory / "sim_profiles.png"),
        plots.plot_qps_sweep(sweep, directory / "sim_qps_sweep.png"),
    ]  # fmt: skip
    for profile in profiles:
        step = {p: kept[(profile, "step", p)] for p in (DEFAULT, "nightjar", "ema", "oracle")}
        trace = {p: kept[(profile, "azure-conv", p)] for p in PLOTTED}
        figures += [
            plots.plot_gamma_timeline(step, directory / f"sim_gamma_{profile}.png",
                                      f"{profile}, step workload (1 → 8 req/s)"),
            plots.plot_throughput_over_time(trace, directory / f"sim_throughput_{profile}.png",
                                            f"{profile}, Azure conv trace at 4 req/s"),
            plots.plot_regret(trace, directory / f"sim_regret_{profile}.png",
                              f"{profile}, Azure conv trace: regret against the oracle"),
        ]  # fmt: skip
    return figures


def render(
    cells: dict[tuple[str, str, str], list[Cell]], profiles: list[str], names: list[str],
    config: BenchConfig, sweep: Sweep | None = None, figures: Sequence[Path] = (),
    relative_to: Path | None = None,
) -> str:  # fmt: skip
    command = "make bench-quick" if config.quick else "make bench"
    lines = [
        "## Serving simulator: policies on traces (`make bench`)",
        "",
        f"Simulated {datetime.date.today().isoformat()} by `{command}` "
        f"(`policy_server/sim/bench.py`), seeds {config.seeds}, acceptance model `chat-sps` "
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
        "power-of-two batch bucket. Workloads: `low`/`high`/`step`/`burst` are Poisson "
        "schedules with Azure conv lengths; `azure-conv` is 10 minutes of the real trace at "
        f"4 req/s; `drift` is {DRIFT_QPS:g} req/s whose requests switch half-way from "
        "α = 0.8 to α = 0.3; `long` is the first 30 minutes of the trace at 4 req/s.",
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
    cells: dict[tuple[str, str, str], list[Cell]], profiles: list[str], names: list[str],
    policies: list[str],
) -> list[str]:  # fmt: skip
    """One table per (profile, workload): every policy, means over seeds."""

    def avg(key: tuple[str, str, str], field: str) -> float:
        return statistics.fmean(getattr(c, field) for c in cells[key])

    lines: list[str] = []
    for profile in profiles:
        for workload in names:
            lines += [f"### {profile} — {workload}", "",
                      "| policy | tok/s | vs oracle | mean e2e s | p99 e2e s | mean TPOT ms "
                      "| regret % |",
                      "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
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
        lines += [f"{profile}: tok/s (mean e2e s)", "",
                  "| policy | " + " | ".join(f"{r:g} qps" for r in rates) + " |",
                  "|---|" + "---:|" * len(rates)]  # fmt: skip
        for policy, points in by_policy.items():
            lines.append(f"| {policy} | " + " | ".join(f"{t:.0f} ({lat:.1f})"
                                                      for _, t, lat in points) + " |")  # fmt: skip
        lines.append("")
    return lines


def targets(
    cells: dict[tuple[str, str, str], list[Cell]], profiles: list[str], names: list[str],
    config: BenchConfig,
) -> list[str]:  # fmt: skip
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
    cells: dict[tuple[str, str, str], list[Cell]], profiles: list[str], names: list[str],
    config: BenchConfig,
) -> list[str]:  # fmt: skip
    """TPOT-SLO attainment of the SLO workloads (mean over seeds)."""
    lines = ["### TPOT SLO mode (`goodput` with `tpot_slo_ms`)", "",
             "Share of requests whose TPOT met the SLO, and throughput; `goodput-slo` runs "
             "the default policy with `tpot_slo_ms` set to the SLO.", ""]  # fmt: skip
    for profile in profiles:
        for workload in (w for w in config.slo_workloads if w in names):
            lines += [f"{profile} — {workload}, SLO {SLO_MS[profile]:g} ms", "",
                      "| policy | SLO attainment | tok/s | mean TPOT ms |",
                      "|---|---:|---:|---:|"]  # fmt: skip
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
