"""What `make bench-load` / `make soak` report: a run's figures, the targets, the sections.

`LoadResult` is one run's figures; the verdicts check them against the issues' targets;
`render_load` / `render_soak` write the sections of docs/BENCHMARKS.md and
`reliability_record` the record under docs/reliability/.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from benchmarks.load_engines import MAX_LAG_S, LoadConfig
from benchmarks.load_sidecar import swap_plan
from benchmarks.report import met

# Targets of the critical-path issue (8 engines × 1,000 decisions/s for 10 min) and of
# the reliability issue's soak.
TARGET_FALLBACK_FRACTION = 0.001
TARGET_RSS_GROWTH = 0.10
TARGET_DECISIONS_PER_CORE = 10_000.0


@dataclasses.dataclass
class LoadResult:
    config: dict[str, Any]
    started: str
    decisions: int
    sidecar_decisions: int
    server_decisions: int
    decisions_per_s: float
    elapsed_s: float
    latency_us: dict[str, float]
    fallbacks: dict[str, int]
    late_replies: int
    prefetch_misses: int
    skipped_behind: int
    errors: int
    error_texts: list[str]
    server_cpu_s: float
    server_cpu_percent: float
    server_decisions_per_cpu_s: float
    rss_start_bytes: int
    rss_warm_bytes: int
    rss_end_bytes: int
    rss_max_bytes: int
    load_average_mean: float
    load_average_max: float
    admin_events: list[dict[str, Any]]
    # The sidecar's policy at start (its default).
    starting_policy: str

    @property
    def fallback_fraction(self) -> float:
        return sum(self.fallbacks.values()) / max(1, self.decisions)

    @property
    def rss_growth(self) -> float:
        """End over the post-warm-up baseline."""
        return self.rss_end_bytes / max(1, self.rss_warm_bytes) - 1

    @property
    def snapshots(self) -> list[dict[str, Any]]:
        return [e for e in self.admin_events if e["action"] == "snapshot"]


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def load_verdicts(run: LoadResult) -> dict[str, bool]:
    """The critical-path issue's targets for a paced run, each met or not."""
    c = run.config
    full = c["engines"] >= 8 and c["rate"] >= 1000 and c["duration_s"] >= 600
    return {
        "8 engines × 1,000 decisions/s for 10 min, rate held (≥ 99 %)": full
        and run.decisions_per_s >= 0.99 * c["engines"] * c["rate"],
        "0 errors": run.errors == 0,
        "fallbacks ≤ 0.1 %": run.fallback_fraction <= TARGET_FALLBACK_FRACTION,
        "sidecar RSS growth ≤ 10 %": run.rss_growth <= TARGET_RSS_GROWTH,
    }


def soak_verdicts(run: LoadResult) -> dict[str, bool]:
    snapshots = run.snapshots
    return {
        "0 errors": run.errors == 0,
        "sidecar RSS growth ≤ 10 %": run.rss_growth <= TARGET_RSS_GROWTH,
        "every snapshot readable and loadable": bool(snapshots) and all(s["ok"] for s in snapshots),
    }


def describe(run: LoadResult) -> str:
    c = run.config
    mode = "pipelined (prefetch/take, as the plugin)" if c["pipelined"] else "blocking decide"
    rate = f"{c['rate']:,.0f} decisions/s each" if c["rate"] else "unpaced (as fast as each can)"
    return (
        f"{c['engines']} engine processes × {rate} for {c['duration_s']:.0f} s, "
        f"{c['transport'].upper()}, one stream per engine, {mode}, "
        f"{c['deadline_s'] * 1000:g} ms deadline"
    )


def run_table(run: LoadResult) -> list[str]:
    lat = run.latency_us
    fallbacks = ", ".join(f"{k} {v}" for k, v in sorted(run.fallbacks.items())) or "none"
    return [
        "| figure | value |",
        "|---|---|",
        f"| decisions (client side) | {run.decisions:,} in {run.elapsed_s:.1f} s |",
        f"| decisions/s achieved | {run.decisions_per_s:,.0f} |",
        f"| decisions served by the sidecar (its counter) | {run.server_decisions:,} "
        f"({run.server_decisions / run.elapsed_s:,.0f}/s) |",
        f"| time to get γ, p50 / p99 / p999 / max | {lat['p50'] / 1000:.3f} / "
        f"{lat['p99'] / 1000:.3f} / {lat['p999'] / 1000:.3f} / {lat['max'] / 1000:.3f} ms |",
        f"| fallbacks | {sum(run.fallbacks.values()):,} ({100 * run.fallback_fraction:.3f} %): "
        f"{fallbacks} |",
        f"| late replies (answered after the deadline) | {run.late_replies:,} |",
        f"| engine fell > {MAX_LAG_S * 1000:.0f} ms behind its schedule | {run.skipped_behind:,} |",
        f"| errors | {run.errors} |",
        f"| sidecar CPU (user + sys) | {run.server_cpu_s:.1f} s, {run.server_cpu_percent:.0f} % "
        f"of one core |",
        f"| sidecar decisions per CPU-second | {run.server_decisions_per_cpu_s:,.0f} |",
        f"| sidecar RSS at start / after warm-up / end / max | {mib(run.rss_start_bytes)} / "
        f"{mib(run.rss_warm_bytes)} / {mib(run.rss_end_bytes)} / {mib(run.rss_max_bytes)} |",
        f"| RSS growth, end over after warm-up ({LoadConfig(**run.config).warmup_s:.0f} s) | "
        f"{100 * run.rss_growth:+.1f} % |",
        f"| machine load average (1 min) during the run, mean / max | "
        f"{run.load_average_mean:.1f} / {run.load_average_max:.1f} ({os.cpu_count()} cores) |",
    ]


def verdict_lines(verdicts: dict[str, bool]) -> list[str]:
    return [f"- {name}: {met(ok)}" for name, ok in verdicts.items()]


def render_load(
    load: LoadResult,
    peak: LoadResult | None,
    header: dict[str, str],
    baseline: LoadResult | None = None,
) -> str:
    lines = [
        "## Many engines on one sidecar (`make bench-load`)",
        "",
        f"Measured {header['date']} on {header['machine']} at commit {header['revision']}, by "
        f"`{header['command']}` "
        "(`benchmarks/load.py`). A real `nightjar-server` process and the engine "
        "processes share the machine's cores; each engine runs the plugin's client "
        "(`NightjarClient`) with simulated step contexts (batch 1–64 as requests join and "
        "finish, KV blocks, context tokens) and reports outcomes consistent with the γ it ran. "
        "Latency is the engine's time to get γ (a fallback counts at its deadline). "
        + header["note"],
        "",
        f"### Paced: {describe(load)}",
        "",
        *run_table(load),
        "",
        "Targets (issue: 8 engines × 1,000 decisions/s for 10 minutes):",
        "",
        *verdict_lines(load_verdicts(load)),
    ]
    if peak is not None:
        per_core = peak.server_decisions_per_cpu_s
        lines += [
            "",
            f"### Most decisions one sidecar serves: {describe(peak)}",
            "",
            *run_table(peak),
            "",
            f"- one sidecar core ≥ {TARGET_DECISIONS_PER_CORE:,.0f} decisions/s: "
            f"{per_core:,.0f} decisions per second of sidecar CPU — "
            f"{met(per_core >= TARGET_DECISIONS_PER_CORE)}",
        ]
    if baseline is not None:
        lines += [
            "",
            f"### Stock gRPC baseline, measured the same way: {describe(baseline)}, against "
            "a bare stream server",
            "",
            "The same engine processes, rate and deadline against `benchmarks/bare_server.py`"
            ": the sidecar's wire contract on a `grpc.aio` server that answers every step with "
            "γ = 1 and does nothing else (no policy, validation, bookkeeping or metrics). The "
            'rows that say "sidecar" are that server\'s.',
            "",
            *run_table(baseline),
            "",
            f"- fallbacks: sidecar {100 * load.fallback_fraction:.3f} %, bare server "
            f"{100 * baseline.fallback_fraction:.3f} %; time to get γ p99: sidecar "
            f"{load.latency_us['p99'] / 1000:.3f} ms, bare server "
            f"{baseline.latency_us['p99'] / 1000:.3f} ms",
        ]
    errors = load.error_texts + (peak.error_texts if peak else [])
    errors += baseline.error_texts if baseline else []
    if errors:
        lines += ["", "Errors seen (first ones):", "", *[f"- `{t}`" for t in errors[:10]]]
    return "\n".join(lines) + "\n"


def render_soak(soak: LoadResult, header: dict[str, str]) -> str:
    swaps = [e for e in soak.admin_events if e["action"] != "snapshot"]
    lines = [
        "## Soak: swaps and snapshots under load (`make soak`)",
        "",
        f"Measured {header['date']} on {header['machine']} at commit {header['revision']}, by "
        f"`{header['command']}` "
        f"(`benchmarks/load.py --soak`). {describe(soak)}; every "
        f"{soak.config['swap_every_s']:g} s a policy swap through the admin RPC (with the admin "
        "token), cycling "
        + ", ".join(f"{n} {json.dumps(p)}" for n, p in swap_plan(soak.starting_policy))
        + " (keep-state whenever the active policy's state schema allows it)"
        + f"; every {soak.config['snapshot_every_s']:g} s a snapshot through the admin RPC, "
        "whose file is then read back (`policy_server/snapshot.py`) and its state loaded into "
        "a fresh instance of its policy. " + header["note"],
        "",
        *run_table(soak),
        f"| swaps (ok / all) | {sum(e['ok'] for e in swaps)} / {len(swaps)} |",
        f"| snapshots readable and loadable | {sum(s['ok'] for s in soak.snapshots)} / "
        f"{len(soak.snapshots)} |",
        "",
        "Targets (issue: 0 errors, RSS growth ≤ 10 %, snapshot always readable):",
        "",
        *verdict_lines(soak_verdicts(soak)),
    ]
    if soak.error_texts:
        lines += ["", "Errors seen (first ones):", "", *[f"- `{t}`" for t in soak.error_texts[:10]]]
    return "\n".join(lines) + "\n"


def reliability_record(
    name: str, what: str, figure: str, verdicts: dict[str, bool], header: dict[str, str]
) -> dict[str, Any]:
    return {
        "test": name,
        "what": what,
        "figure": figure,
        "passed": all(verdicts.values()),
        "date": header["date"],
        "machine": header["machine"],
        "command": header["command"],
    }


def summary_figure(run: LoadResult) -> str:
    return (
        f"{run.errors} errors; {run.decisions:,} decisions at {run.decisions_per_s:,.0f}/s; "
        f"fallbacks {100 * run.fallback_fraction:.3f} %; p99 "
        f"{run.latency_us['p99'] / 1000:.2f} ms; RSS {mib(run.rss_warm_bytes)} → "
        f"{mib(run.rss_end_bytes)} ({100 * run.rss_growth:+.1f} %)"
    )
