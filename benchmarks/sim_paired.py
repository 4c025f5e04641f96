"""`make bench-sim-paired`: per-request γ against batch γ, seed by seed.

The per-sequence mode against the per-batch default, and its ceiling against the batch-γ
oracle, over more seeds than `make bench` runs.

The mixed-population section (benchmarks/sim_mixed.py) judges `goodput-per-request`
against `goodput` by the ratio of their means over three seeds and the default's own
spread over them; the arrivals and each request's α are the same for both policies in a
seed, so the seeds' ratios are paired, and a mode that is a little faster in every seed
is lost in the seed spread the two policies share. This runs the two policies on
the section's cells (each homogeneous workload and the mixed ones that replay its
arrivals) for seeds 1..N and reports, per cell and figure, the geometric mean of the
seeds' ratios with its 95 % Student-t interval, and how many seeds the mode was lower in
(with the exact two-sided sign test). The same for the ceiling (`oracle-per-request`,
each step's best plan from every request's true α, against `oracle`, the step's best batch
γ): what per-request γ buys at best in step goodput, which bounds the step's goodput a
learned plan gets, not its latency. The runs are spread over worker processes; each is
the matrix's own `simulate` and deterministic, so the figures do not depend on how many.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import functools
import math
import os
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

import nightjar_data

from benchmarks.report import write_section
from benchmarks.sim_mixed import DEFAULT, MODE, ORACLES, Cells, comparison_rows
from policy_server.sim.profile import HardwareProfile, builtin_profiles
from policy_server.sim.runs import (
    DATA_HELP,
    GAMMA_MAX,
    BenchConfig,
    Cell,
    ProfileAssets,
    mixed_workloads,
    simulate,
    summarise,
    workloads,
)
from policy_server.sim.workload import RequestSpec

SECTION = "bench-sim-paired"
# ``--only-default``: the first table alone, in a section of its own before the full one.
DEFAULT_SECTION = "bench-sim-paired-default"
SEEDS = 10
# (field of a Cell, its name in the table); e2e first: what the mode's target judges.
FIGURES = (("mean_latency", "mean e2e"), ("mean_tpot_ms", "mean TPOT"), ("throughput", "tok/s"))
CONFIDENCE = 0.95


@dataclasses.dataclass(frozen=True)
class Comparison:
    """``mine`` against ``theirs`` on the same arrivals and per-request α, seed by seed."""

    mine: str
    theirs: str
    # The table's heading, and what it is run for.
    title: str
    purpose: str


# The default's per-request mode forced off: the batch γ alone.
BATCH = "goodput-batch"
COMPARISONS = (
    Comparison(
        DEFAULT,
        BATCH,
        "The default against the batch γ",
        f"`{DEFAULT}` with its defaults (`per_request: auto`: an engine plans per request "
        "only while its requests' learned acceptance is surely far enough apart for a plan "
        f"to beat the batch γ) against `{BATCH}` (`per_request: false`, the default "
        "before). Issue 57's targets: in every homogeneous and published-mix cell the e2e "
        "interval holds 1 or lies below it; on 7B `azure-conv-easy-hard` it lies below 1, "
        "and on no `easy-hard` cell above it. In the simulator a batch-γ source gets no "
        "per-request accepts (the vLLM plugin sends them to every policy), so the two "
        "learn the pooled α apart even where the default never plans.",
    ),
    Comparison(
        MODE,
        BATCH,
        "The per-sequence mode forced on against the batch γ",
        f"`{MODE}` (`per_request: true`) against the same `{BATCH}`: what planning on "
        "every engine all the time does (the default's table before issue 57).",
    ),
    Comparison(
        ORACLES[1],
        ORACLES[0],
        "The ceiling: per-request γ against batch γ, both from the true α",
        f"`{ORACLES[1]}` runs each step's best plan (cap and γ_i) from every request's true "
        f"α, `{ORACLES[0]}` the step's best batch γ; both maximise the step's expected "
        "goodput and neither looks further ahead: the mode's design with nothing to "
        "learn. It bounds the step goodput a learned plan gets, not its latency: where "
        "requests queue, the mode can land on either side of it.",
    ),
)

# What each worker process simulates with, set once per process (``_start_worker``).
_profiles: dict[str, HardwareProfile] = {}
_arrivals: dict[int, dict[str, list[RequestSpec]]] = {}
_config: BenchConfig | None = None


@functools.cache
def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (p in [0.5, 1)) of Student's t with ``df`` degrees of freedom:
    bisection on its CDF, the density integrated by Simpson's rule (no SciPy here)."""
    scale = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(x: float, steps: int = 2000) -> float:
        h = x / steps
        density = [
            scale * float((1 + (i * h) ** 2 / df) ** (-(df + 1) / 2)) for i in range(steps + 1)
        ]
        odd, even = sum(density[1:-1:2]), sum(density[2:-1:2])
        return 0.5 + h / 3 * (density[0] + 4 * odd + 2 * even + density[-1])

    low, high = 0.0, 1000.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) < p else (low, middle)
    return (low + high) / 2


def sign_test(lower: int, higher: int) -> float:
    """Exact two-sided p-value of ``lower`` against ``higher`` seeds (ties left out)."""
    n = lower + higher
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(lower, higher) + 1)) / 2.0**n
    return min(1.0, 2 * tail)


@dataclasses.dataclass(frozen=True)
class PairedRatio:
    """One figure of ``mine`` over ``theirs``, seed by seed: the geometric mean of the
    seeds' ratios with its interval, and the seeds in which ``mine`` was lower / higher."""

    centre: float
    low: float
    high: float
    lower: int
    higher: int
    seeds: int

    @classmethod
    def of(cls, mine: Sequence[Cell], theirs: Sequence[Cell], field: str) -> PairedRatio:
        ratios = [getattr(m, field) / getattr(t, field) for m, t in zip(mine, theirs, strict=True)]
        logs = [math.log(r) for r in ratios]
        centre = statistics.fmean(logs)
        half = 0.0
        if len(logs) > 1:
            error = statistics.stdev(logs) / math.sqrt(len(logs))
            half = t_quantile(0.5 + CONFIDENCE / 2, len(logs) - 1) * error
        return cls(
            math.exp(centre),
            math.exp(centre - half),
            math.exp(centre + half),
            sum(r < 1 for r in ratios),
            sum(r > 1 for r in ratios),
            len(ratios),
        )

    @property
    def separation(self) -> str:
        """ "lower" or "higher" where the interval lies below or above 1, else "not
        separated"."""
        return "lower" if self.high < 1 else "higher" if self.low > 1 else "not separated"

    def cells(self) -> str:
        """Two table cells: "0.985 [0.977, 0.993] | 9/10, p 0.021"."""
        p = sign_test(self.lower, self.higher)
        return (
            f"{self.centre:.3f} [{self.low:.3f}, {self.high:.3f}] "
            f"| {self.lower}/{self.seeds}, p {p:.2g}"
        )


def render(
    cells: Cells,
    profiles: Sequence[str],
    seeds: Sequence[int],
    command: str,
    comparisons: Sequence[Comparison] = COMPARISONS,
) -> str:
    heads = " | ".join(f"{name} ratio [95 % CI] | seeds lower" for _, name in FIGURES)
    lines = [
        "## Serving simulator: per-request γ against batch γ, seed by seed "
        "(`make bench-sim-paired`)",
        "",
        f"Simulated {datetime.date.today().isoformat()} by `{command}` "
        f"(`benchmarks/sim_paired.py`), seeds {seeds[0]}–{seeds[-1]}, Γmax = {GAMMA_MAX}, "
        "the profiles, workloads and populations of the mixed-population section above "
        "(`chat-sps` for the homogeneous rows). Each table runs a per-request policy "
        "against a batch-γ one on the same arrivals and per-request α in each seed: per "
        "figure, the geometric mean of the seeds' ratios (the first policy's over the "
        f"second's; below 1 is lower) with its {CONFIDENCE:.0%} Student-t interval, and "
        "the seeds in which the first was lower with the exact two-sided sign test's p. "
        "`mean e2e` says whether the interval of the e2e ratio lies below 1 (lower), above "
        "it (higher), or holds it.",
        "",
    ]
    for comparison in comparisons:
        mine, theirs = comparison.mine, comparison.theirs
        lines += [
            f"### {comparison.title} (`{mine}` against `{theirs}`)",
            "",
            comparison.purpose,
            "",
            f"| profile | workload | {heads} | mean e2e |",
            "|---|---|" + "---:|---:|" * len(FIGURES) + "---|",
        ]
        for profile, workload, _ in comparison_rows(profiles):
            ratios = [
                PairedRatio.of(
                    cells[(profile, workload, mine)], cells[(profile, workload, theirs)], field
                )
                for field, _ in FIGURES
            ]
            figures = " | ".join(ratio.cells() for ratio in ratios)
            lines.append(f"| {profile} | `{workload}` | {figures} | {ratios[0].separation} |")
        lines.append("")
    return "\n".join(lines)


def paired_jobs(
    profiles: Sequence[str],
    seeds: Sequence[int],
    comparisons: Sequence[Comparison] = COMPARISONS,
) -> list[tuple[str, str, str, int]]:
    """(profile, workload, policy, seed) of every run the comparisons need: each policy
    once per cell and seed, however many comparisons it is in."""
    policies = dict.fromkeys(p for c in comparisons for p in (c.theirs, c.mine))
    return [
        (profile, workload, policy, seed)
        for profile, workload, _ in comparison_rows(profiles)
        for policy in policies
        for seed in seeds
    ]


def _start_worker(
    profiles: dict[str, HardwareProfile],
    arrivals: dict[int, dict[str, list[RequestSpec]]],
    config: BenchConfig,
) -> None:
    global _config
    _profiles.update(profiles)
    _arrivals.update(arrivals)
    _config = config


def _run(job: tuple[str, str, str, int]) -> Cell:
    profile, workload, policy, seed = job
    assert _config is not None, "a worker simulates after _start_worker"
    result = simulate(
        _profiles[profile], _arrivals[seed][workload], policy, _config, seed, workload
    )
    return summarise(profile, workload, policy, result)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-sim-paired", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"))
    parser.add_argument("--data", type=Path, default=nightjar_data.ROOT, help=DATA_HELP)
    parser.add_argument("--seeds", type=int, default=SEEDS, help="seeds 1..N (default 10)")
    parser.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="processes (default: cores)"
    )
    parser.add_argument(
        "--only-default",
        action="store_true",
        help="the default against the batch γ alone (2 of the 5 policies), in a section of its own",
    )
    args = parser.parse_args(argv)
    comparisons = COMPARISONS[:1] if args.only_default else COMPARISONS
    if args.seeds < 2:
        parser.error("--seeds must be at least 2 (an interval needs two)")
    seeds = list(range(1, args.seeds + 1))
    profiles = builtin_profiles(args.data / "calibration")
    arrivals = {}
    for seed in seeds:
        homogeneous = workloads(args.data, seed, quick=False)
        arrivals[seed] = {**homogeneous, **mixed_workloads(homogeneous)}
    jobs = paired_jobs(list(profiles), seeds, comparisons)
    # Imported here, like matplotlib: the simulator works without the `sim` extra.
    from tqdm import tqdm

    cells: Cells = {}
    with tempfile.TemporaryDirectory(prefix="nightjar-bench-") as scratch:
        assets = {
            name: ProfileAssets.build(profile, Path(scratch)) for name, profile in profiles.items()
        }
        config = BenchConfig(args.data, seeds, False, assets=assets)
        with concurrent.futures.ProcessPoolExecutor(
            args.workers, initializer=_start_worker, initargs=(profiles, arrivals, config)
        ) as pool:
            for cell in tqdm(pool.map(_run, jobs), total=len(jobs), unit="run"):
                cells.setdefault((cell.profile, cell.workload, cell.policy), []).append(cell)
    if args.only_default:
        command = f"python -m benchmarks.sim_paired --seeds {args.seeds} --only-default"
        section = DEFAULT_SECTION
    else:
        command = "make bench-sim-paired" + (
            f" PAIRED_SEEDS={args.seeds}" if args.seeds != SEEDS else ""
        )
        section = SECTION
    text = render(cells, list(profiles), seeds, command, comparisons)
    write_section(args.out, section, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
