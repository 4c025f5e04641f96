"""Named policy runs in the serving simulator: the decision sources the simulator's users
pick by name (`nightjar-sim --policies`, `make demo`, the benchmark matrix), the assets an
operator measures per deployment, and one run's summary.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from policy_server.policies.dsd import fit_latency
from policy_server.sim.acceptance import (
    EASY,
    HARD,
    MIXES,
    WORKLOADS,
    Acceptance,
    AcceptanceMix,
    AcceptanceModel,
    AcceptanceSchedule,
)
from policy_server.sim.engine import DecisionSource, SimConfig, SimResult, Simulator
from policy_server.sim.profile import HardwareProfile
from policy_server.sim.sources import (
    OracleSource,
    PolicySource,
    RequestOracleSource,
    TableSource,
)
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
    pass

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


def _learning(policy: str, tables: int = 0, **params: object) -> SourceFactory:
    """Deployed as their papers run them: with the engine's profiled switching cost;
    ``tables`` > 0: through decision tables refreshed every that many steps."""

    def make(seed: int, assets: ProfileAssets) -> DecisionSource:
        named = {
            "seed": seed,
            "gamma_max": GAMMA_MAX,
            "prefill_cost_table": assets.prefill_cost_table,
            **params,
        }
        if tables:
            return TableSource.named(policy, named, refresh_steps=tables)
        return PolicySource.named(policy, named)

    return make


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
    # Per-request γ (each request's own from its recent accepts, capped per batch).
    "dsde": lambda seed, assets: PolicySource.named("dsde", {"gamma_max": GAMMA_MAX}),
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
# The default policy through decision tables (docs/DECISION_TABLES.md), by refresh period
# in steps: what the per-step protocol's replacement would decide; not in the matrix.
TABLE_MODE: dict[str, SourceFactory] = {
    f"goodput-tables-{steps}": _learning("goodput", tables=steps) for steps in (8, 32)
}
# The default policy's per-sequence mode forced on (a γ per request from its own
# acceptance, under the batch cap; docs/POLICIES.md, "Per-request mode"), and forced off
# (the batch γ alone, the default before it planned per request by itself): what
# `make bench-sim-paired` sets the default against.
PER_REQUEST_MODE: dict[str, SourceFactory] = {
    "goodput-per-request": _learning("goodput", per_request=True),
    "goodput-batch": _learning("goodput", per_request=False),
}
# The limit of per-request γ (each step's best plan from the requests' true α): the
# ceiling of the per-sequence mode on the mixed populations.
REQUEST_ORACLE: dict[str, SourceFactory] = {
    "oracle-per-request": lambda seed, assets: RequestOracleSource(),
}
FIXED = ["off"] + [p for p in POLICIES if p.startswith("static-")]
# The policy the targets are judged for: the server's default.
DEFAULT = "goodput"
SWEEP_POLICIES = [
    "goodput",
    "nightjar",
    "off",
    "static-1",
    "static-3",
    "table",
    "ema",
    "dsd",
    "oracle",
]
# Lines in the over-time plots (all of them would be unreadable).
PLOTTED = ["goodput", "nightjar", "off", "static-1", "ema", "table", "oracle"]
SLO_WORKLOADS = ("step", "azure-conv")
SLO_POLICIES = ["goodput-slo", "goodput", "static-1", "static-2", "table", "ema", "dsd", "oracle"]
# `make bench-quick` (the CI smoke run): fewer policies, SLO on one workload, one rate.
QUICK_POLICIES = [
    "goodput",
    "nightjar",
    "off",
    "static-1",
    "static-3",
    "table",
    "ema",
    "dsd",
    "dsde",
    "oracle",
]
# Mixed populations (per-sequence γ): a `make bench` workload's arrivals whose requests
# draw α from a mix of categories (acceptance.MIXES) instead of the bench's one model; the
# "-wide" ones from the published mix whose categories lie further apart, the "-easy-hard"
# ones from the drift workload's two populations (α 0.8 and 0.3) at once.
MIXED = {
    "step-mix": ("step", "code-writing"),
    "azure-conv-mix": ("azure-conv", "code-writing"),
    "step-mix-wide": ("step", "code-translation"),
    "azure-conv-mix-wide": ("azure-conv", "code-translation"),
    "step-easy-hard": ("step", "easy-hard"),
    "azure-conv-easy-hard": ("azure-conv", "easy-hard"),
}
MIXED_POLICIES = [
    "goodput",
    "goodput-per-request",
    "nightjar",
    "off",
    *(f"static-{g}" for g in range(1, GAMMA_MAX + 1)),
    "ema",
    "dsd",
    "dsde",
    "oracle",
    "oracle-per-request",
]


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
    # A name of POPULATIONS: one acceptance model or a mix.
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
            seed=seed,
            gamma_max=GAMMA_MAX,
            chunked_prefill=self.chunked_prefill,
            track_regret=True,
        )


# The drift workload: the request mix changes half-way from one a draft predicts well to
# one it predicts badly (acceptance.EASY, acceptance.HARD).
DRIFT_SECONDS = 240.0
DRIFT_QPS = 3.0
DRIFT_PHASES = (EASY, HARD)
# The long workload: the first 30 minutes of the Azure conv trace at 4 req/s.
LONG_SECONDS = 1800.0


def workloads(data: Path, seed: int, quick: bool) -> dict[str, list[RequestSpec]]:
    trace = read_trace(data / "traces" / "azure_llm_2023_conv.csv")
    scale = 0.5 if quick else 1.0
    out = {
        name: synthetic(
            [dataclasses.replace(p, seconds=p.seconds * scale) for p in phases], trace, seed
        )
        for name, phases in SCHEDULES.items()
    }
    # A slice of the real trace at its own burstiness, rescaled to 4 req/s.
    out["azure-conv"] = scale_to_qps(window(trace, 0, 600 * scale), 4.0)
    out["drift"] = synthetic([RatePhase(DRIFT_SECONDS * scale, DRIFT_QPS)], trace, seed)
    if not quick:
        out["long"] = scale_to_qps(window(trace, 0, LONG_SECONDS), 4.0)
    return out


# The request populations a run can name: one model, or a mix of categories.
POPULATIONS: dict[str, AcceptanceModel | AcceptanceMix] = {**WORKLOADS, **MIXES}


def mixed_workloads(homogeneous: Mapping[str, list[RequestSpec]]) -> dict[str, list[RequestSpec]]:
    """The mixed-population workloads: the arrivals of the homogeneous ones they name."""
    return {name: homogeneous[base] for name, (base, _) in MIXED.items()}


def acceptance_of(workload: str, specs: Sequence[RequestSpec], bench: BenchConfig) -> Acceptance:
    """The request mix of a workload: the bench's model, a mixed population, or the drift
    schedule."""
    if workload in MIXED:
        return MIXES[MIXED[workload][1]]
    if workload != "drift":
        return POPULATIONS[bench.acceptance]
    half = (specs[-1].arrival_s if specs else 0.0) / 2
    return AcceptanceSchedule(((0.0, DRIFT_PHASES[0]), (half, DRIFT_PHASES[1])))


def simulate(
    profile: HardwareProfile,
    specs: list[RequestSpec],
    policy: str,
    bench: BenchConfig,
    seed: int,
    workload: str = "",
) -> SimResult:
    factory = {**POLICIES, **SLO_ONLY, **TABLE_MODE, **PER_REQUEST_MODE, **REQUEST_ORACLE}[policy]
    source = factory(seed, bench.assets.get(profile.name, ProfileAssets()))
    acceptance = acceptance_of(workload, specs, bench)
    return Simulator(profile, acceptance, specs, source, bench.sim(seed)).run()


def summarise(profile: str, workload: str, policy: str, result: SimResult) -> Cell:
    lat = result.latencies()
    return Cell(
        profile,
        workload,
        policy,
        result.throughput,
        statistics.fmean(lat),
        lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        1000 * statistics.fmean(result.tpots()),
        result.generated_tokens,
        result.regret_tokens,
    )


def attainment(result: SimResult, slo_ms: float) -> float:
    """Share of finished requests whose TPOT met ``slo_ms``."""
    tpots = result.tpots()
    return sum(1000 * t <= slo_ms for t in tpots) / len(tpots) if tpots else 0.0


def summary_table(cells: Mapping[str, Cell], reference: str = "oracle") -> list[str]:
    """Plain-text table of one workload's runs, throughput relative to `reference`."""
    base = cells[reference].throughput if reference in cells else 0.0
    lines = [
        f"{'policy':<20} {'tok/s':>7} {'vs ' + reference:>10} {'mean e2e s':>10} "
        f"{'p99 e2e s':>9} {'TPOT ms':>8} {'regret %':>8}"
    ]
    for name, c in cells.items():
        regret = 100 * c.regret_tokens / c.generated_tokens if c.generated_tokens else 0.0
        ratio = f"{c.throughput / base:.3f}" if base else "-"
        lines.append(
            f"{name:<20} {c.throughput:>7.0f} {ratio:>10} {c.mean_latency:>10.2f} "
            f"{c.p99_latency:>9.2f} {c.mean_tpot_ms:>8.1f} {regret:>8.2f}"
        )
    return lines
