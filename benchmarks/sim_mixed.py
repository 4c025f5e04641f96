"""`make bench`'s mixed-population cells: per-sequence γ beside the homogeneous workloads.

The arrivals of two matrix workloads (`runs.MIXED`) run once more with each request's α
drawn from a mix of categories (`acceptance.MIXES`), every policy of `runs.MIXED_POLICIES`
on both profiles and every seed; `dsde` and `goodput-per-request` (the default's
per-sequence mode) answer a γ per request, the others one γ per step. The section shows
the homogeneous cell (the matrix's, or run here with `--mixed-only`) beside the mixed one,
with the spread over seeds, each per-request policy against the batch-γ policies, and the
per-sequence mode against the per-batch default seed by seed, with the targets it is
judged by (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import datetime
import statistics
from collections.abc import Callable, Collection, Iterator, Sequence

from policy_server.sim.acceptance import MIXES
from policy_server.sim.profile import HardwareProfile
from policy_server.sim.runs import (
    GAMMA_MAX,
    MIXED,
    MIXED_POLICIES,
    BenchConfig,
    Cell,
    mixed_workloads,
    simulate,
    summarise,
)
from policy_server.sim.workload import RequestSpec

SECTION = "bench-sim-mixed"
# The policies that answer a γ per request; the per-sequence mode of the default; the
# oracles of a batch γ and of per-request γ (each step's best plan from the true α).
PER_REQUEST = ("dsde", "goodput-per-request")
MODE = "goodput-per-request"
DEFAULT = "goodput"
ORACLES = ("oracle", "oracle-per-request")
# The mode's targets: on mixed cells, mean e2e and tok/s ahead of the default's by more
# than the default's seed spread; on homogeneous cells, neither worse by more than 0.2 %.
HOMOGENEOUS_LOSS = 0.002

Cells = dict[tuple[str, str, str], list[Cell]]


def jobs(done: Collection[str]) -> list[tuple[str, str]]:
    """(workload, policy) pairs to run per profile and seed: every mixed cell, and the
    homogeneous cells beside them whose policy the matrix did not run (``done``)."""
    mixed = [(name, policy) for name in MIXED for policy in MIXED_POLICIES]
    bases = dict.fromkeys(base for base, _ in MIXED.values())  # each once, in order
    homogeneous = [
        (base, policy) for base in bases for policy in MIXED_POLICIES if policy not in done
    ]
    return mixed + homogeneous


def run_cells(
    profiles: dict[str, HardwareProfile],
    per_seed: dict[int, dict[str, list[RequestSpec]]],
    config: BenchConfig,
    todo: Sequence[tuple[str, str]],
    cells: Cells,
    tick: Callable[[str], None],
) -> None:
    """Run ``todo`` on every profile and seed through the matrix's own `simulate`, adding
    the cells to ``cells``; ``tick`` is told each run."""
    arrivals = {seed: {**specs, **mixed_workloads(specs)} for seed, specs in per_seed.items()}
    for profile_name, profile in profiles.items():
        for workload, policy in todo:
            for seed in config.seeds:
                result = simulate(profile, arrivals[seed][workload], policy, config, seed, workload)
                cell = summarise(profile_name, workload, policy, result)
                cells.setdefault((profile_name, workload, policy), []).append(cell)
                tick(f"{profile_name} {workload} {policy} seed {seed}")


def _mean(runs: Sequence[Cell], field: str) -> float:
    return statistics.fmean(getattr(c, field) for c in runs)


def _spread(runs: Sequence[Cell], field: str, digits: int) -> str:
    """The mean over seeds with its range: "774 (771–778)"."""
    values = [getattr(c, field) for c in runs]
    mean = f"{statistics.fmean(values):.{digits}f}"
    if len(values) < 2:
        return mean
    return f"{mean} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def _regret(runs: Sequence[Cell]) -> float:
    generated = _mean(runs, "generated_tokens")
    return 100 * _mean(runs, "regret_tokens") / generated if generated else 0.0


def cell_table(cells: Cells, profile: str, mixed: str) -> list[str]:
    """One (profile, arrivals) table: the homogeneous and the mixed population per policy."""
    base, mix = MIXED[mixed]
    lines = [
        f"### {profile} — `{base}` arrivals: `chat-sps` beside `{mix}`",
        "",
        "| policy | chat-sps tok/s | mean e2e s | mean TPOT ms | regret % "
        f"| {mix} tok/s (seed range) | vs oracle | mean e2e s | mean TPOT ms (seed range) "
        "| regret % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    oracle = _mean(cells[(profile, mixed, "oracle")], "throughput")
    for policy in MIXED_POLICIES:
        same, mixes = cells[(profile, base, policy)], cells[(profile, mixed, policy)]
        lines.append(
            f"| {policy} | {_mean(same, 'throughput'):.0f} | {_mean(same, 'mean_latency'):.2f} "
            f"| {_mean(same, 'mean_tpot_ms'):.1f} | {_regret(same):.2f} "
            f"| {_spread(mixes, 'throughput', 0)} | {_mean(mixes, 'throughput') / oracle:.3f} "
            f"| {_mean(mixes, 'mean_latency'):.2f} | {_spread(mixes, 'mean_tpot_ms', 1)} "
            f"| {_regret(mixes):.2f} |"
        )
    return [*lines, ""]


def against_batch(cells: Cells, profiles: Sequence[str], policy: str) -> list[str]:
    """``policy`` (a per-request one) against the default and against the best batch-γ
    policy (by mean TPOT, the oracle left out), per profile and workload, from the means
    over seeds."""
    rivals = [p for p in MIXED_POLICIES if p not in (*PER_REQUEST, *ORACLES)]
    lines = [
        f"### `{policy}` (per-request γ) against the batch-γ policies",
        "",
        f"Ratios of means over seeds: tok/s and mean TPOT of `{policy}` over those of "
        f"`{DEFAULT}` and of the batch-γ policy with the lowest mean TPOT in the cell "
        "(the oracle left out); TPOT below 1 is better.",
        "",
        f"| profile | workload | tok/s / {DEFAULT} | TPOT / {DEFAULT} | best batch-γ (TPOT ms) "
        "| tok/s / best | TPOT / best |",
        "|---|---|---:|---:|---|---:|---:|",
    ]
    for profile, workload, _ in comparison_rows(profiles):
        mine = cells[(profile, workload, policy)]
        default = cells[(profile, workload, DEFAULT)]
        best = min(rivals, key=lambda p: _mean(cells[(profile, workload, p)], "mean_tpot_ms"))
        theirs = cells[(profile, workload, best)]
        lines.append(
            f"| {profile} | `{workload}` | {_ratios(mine, default)} "
            f"| {best} ({_mean(theirs, 'mean_tpot_ms'):.1f}) | {_ratios(mine, theirs)} |"
        )
    return [*lines, ""]


def against_default(cells: Cells, profiles: Sequence[str]) -> list[str]:
    """The per-sequence mode against the per-batch default, seed by seed (the same
    arrivals and α of each request), with the default's seed spread and the targets."""
    lines = [
        f"### `{MODE}` against `{DEFAULT}`: the targets",
        "",
        f"Ratios of `{MODE}`'s figure to `{DEFAULT}`'s: of the means over seeds, and in "
        "parentheses the lowest and highest of the seeds' own ratios (a seed's two runs "
        f"share arrivals and each request's α). Spread: the range of `{DEFAULT}`'s "
        "figure over the seeds, relative to its mean. Target (issue 30): on a "
        "mixed population, mean e2e lower and tok/s higher by more than the spread; on "
        f"`chat-sps`, neither worse by more than {HOMOGENEOUS_LOSS:.1%}.",
        "",
        "| profile | workload | tok/s ratio | spread | mean e2e ratio | spread "
        "| mean TPOT ratio | target |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for profile, workload, mixed in comparison_rows(profiles):
        mine, default = cells[(profile, workload, MODE)], cells[(profile, workload, DEFAULT)]
        lines.append(f"| {profile} | `{workload}` | {_judged(mine, default, mixed)} |")
    return [*lines, ""]


def ceiling(cells: Cells, profiles: Sequence[str]) -> list[str]:
    """What per-request γ can win at most: the per-request oracle against the batch-γ
    oracle, seed by seed, judged by the mode's own targets."""
    batch, per_request = ORACLES
    lines = [
        f"### The ceiling: `{per_request}` against `{batch}`",
        "",
        f"`{per_request}` runs each step's best plan (cap and γ_i) from every request's true "
        f"α, `{batch}` the step's best batch γ; both maximise the step's expected goodput "
        "(decode tokens per second of step time), neither looks further ahead. Ratios as "
        f"in the targets' table below (of the means; in parentheses the seeds' own); spread: "
        f"`{batch}`'s over the seeds; goodput gain: expected tokens per step time over "
        f"`{batch}`'s (minus the regret, seeds' range). Target: the mode's, for "
        f"`{per_request}` over `{batch}`. The ceiling bounds a plan's expected step goodput, "
        "not the latency it buys: where requests queue, a learned plan can land on either "
        "side of it.",
        "",
        "| profile | workload | goodput gain | tok/s ratio | spread | mean e2e ratio | spread "
        "| mean TPOT ratio | target |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for profile, workload, mixed in comparison_rows(profiles):
        mine, theirs = (cells[(profile, workload, p)] for p in (per_request, batch))
        gains = [-100 * c.regret_tokens / max(c.generated_tokens, 1) for c in mine]
        gain = f"{statistics.fmean(gains):+.2f} % ({min(gains):+.2f}–{max(gains):+.2f})"
        lines.append(f"| {profile} | `{workload}` | {gain} | {_judged(mine, theirs, mixed)} |")
    return [*lines, ""]


def comparison_rows(profiles: Sequence[str]) -> Iterator[tuple[str, str, bool]]:
    """(profile, workload, whether its population is mixed) of every row of the
    comparison tables: each homogeneous workload once, before the first mixed one that
    replays its arrivals."""
    for profile in profiles:
        shown: set[str] = set()
        for mixed, (base, _) in MIXED.items():
            if base not in shown:
                shown.add(base)
                yield profile, base, False
            yield profile, mixed, True


def _judged(mine: Sequence[Cell], theirs: Sequence[Cell], mixed: bool) -> str:
    """The target table's cells for ``mine`` against ``theirs``: the paired ratios of
    tok/s, mean e2e (each with ``theirs``' seed spread) and mean TPOT, and the verdict."""
    met = _target_met(mine, theirs, mixed)
    return (
        f"{_paired(mine, theirs, 'throughput')} "
        f"| {_relative_spread(theirs, 'throughput'):.2%} "
        f"| {_paired(mine, theirs, 'mean_latency')} "
        f"| {_relative_spread(theirs, 'mean_latency'):.2%} "
        f"| {_paired(mine, theirs, 'mean_tpot_ms')} | {'met' if met else 'missed'}"
    )


def _target_met(mine: Sequence[Cell], default: Sequence[Cell], mixed: bool) -> bool:
    throughput = _mean(mine, "throughput") / _mean(default, "throughput")
    latency = _mean(mine, "mean_latency") / _mean(default, "mean_latency")
    if not mixed:
        return throughput >= 1 - HOMOGENEOUS_LOSS and latency <= 1 + HOMOGENEOUS_LOSS
    return throughput - 1 > _relative_spread(
        default, "throughput"
    ) and 1 - latency > _relative_spread(default, "mean_latency")


def _paired(mine: Sequence[Cell], theirs: Sequence[Cell], field: str) -> str:
    """The ratio of the means, with the range of the seeds' own ratios: "0.990 (0.98–1.00)"."""
    ratio = _mean(mine, field) / _mean(theirs, field)
    per_seed = [getattr(m, field) / getattr(t, field) for m, t in zip(mine, theirs, strict=True)]
    if len(per_seed) < 2:
        return f"{ratio:.3f}"
    return f"{ratio:.3f} ({min(per_seed):.3f}–{max(per_seed):.3f})"


def _relative_spread(runs: Sequence[Cell], field: str) -> float:
    values: list[float] = [getattr(c, field) for c in runs]
    return (max(values) - min(values)) / statistics.fmean(values)


def _ratios(mine: Sequence[Cell], theirs: Sequence[Cell]) -> str:
    """Two table cells: tok/s and mean TPOT of ``mine`` over ``theirs``."""
    return " | ".join(
        f"{_mean(mine, field) / _mean(theirs, field):.3f}"
        for field in ("throughput", "mean_tpot_ms")
    )


def render(cells: Cells, profiles: Sequence[str], config: BenchConfig, command: str) -> str:
    mixes = ", ".join(
        f"`{name}` = "
        + " + ".join(
            f"{weight:.0%} {model.name} (α ≈ {model.mean:.2f})"
            for weight, model in MIXES[name].parts
        )
        for name in sorted({mix for _, mix in MIXED.values()})
    )
    lines = [
        "## Serving simulator: mixed populations and per-sequence γ (`make bench`)",
        "",
        f"Simulated {datetime.date.today().isoformat()} by `{command}` "
        f"(`benchmarks/sim_matrix.py`, `benchmarks/sim_mixed.py`), seeds {config.seeds}, "
        f"Γmax = {GAMMA_MAX}, chunked prefill {'on' if config.chunked_prefill else 'off'}, "
        "the profiles and settings of the matrix above. Each table replays one matrix "
        "workload's arrivals twice: with the matrix's `chat-sps` population (α ≈ 0.58 per "
        f"request on average), and with a mixed population: {mixes} (each request's "
        "category drawn by weight, then its α from a Beta around the category's mean; "
        'docs/SIMULATOR.md, "Per-sequence γ"). '
        "`dsde` and `goodput-per-request` (the default's per-sequence mode, "
        'docs/POLICIES.md "Per-request mode") answer a γ per request (the drafter runs the '
        "batch cap, each request verifies its own); every other policy one γ per step. "
        "`oracle-per-request` is the limit of per-request γ: each step's best plan from "
        "every request's true α. `vs oracle` and "
        "`regret` are against the per-step batch-γ oracle, which a per-request choice can "
        "beat (regret < 0). Seed ranges are the lowest and highest of the seeds' figures.",
        "",
    ]
    for profile in profiles:
        for mixed in MIXED:
            lines += cell_table(cells, profile, mixed)
    for policy in PER_REQUEST:
        lines += against_batch(cells, profiles, policy)
    lines += against_default(cells, profiles)
    lines += ceiling(cells, profiles)
    return "\n".join(lines)
