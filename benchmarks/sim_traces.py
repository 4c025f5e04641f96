"""`make bench-traces`: the policies on request traces their defaults were not tuned on.

`make bench` replays the Azure conv trace, the one the policies were developed against.
This runs the same simulator, policies and targets on two traces nobody looked at while
tuning: the Azure code trace (Patel et al., ISCA 2024: short outputs, prompts of a few
thousand tokens) and Moonshot AI's Mooncake conversation trace (Qin et al., FAST 2025:
prompts of 7k tokens and more), ten minutes of each on both profiles, and writes its
section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import nightjar_data

from benchmarks.report import write_section
from benchmarks.sim_matrix import cell_tables, targets
from policy_server.sim.profile import builtin_profiles
from policy_server.sim.runs import (
    DATA_HELP,
    GAMMA_MAX,
    BenchConfig,
    Cell,
    ProfileAssets,
    simulate,
    summarise,
)
from policy_server.sim.workload import RequestSpec, read_trace, scale_to_qps, window

SECTION = "bench-traces"
SECONDS = 600.0
# The code trace at the rate `make bench` replays the conv trace; the Mooncake trace at
# its own rate (3.4 req/s of long prompts: it saturates either profile's prefill).
TRACES = {
    "azure-code": ("azure_llm_2023_code.csv", 4.0),
    "mooncake-conv": ("mooncake_conversation.csv", None),
}
POLICIES = [
    "goodput",
    "nightjar",
    "off",
    "static-1",
    "static-2",
    "static-3",
    "static-4",
    "table",
    "ema",
    "dsd",
    "oracle",
]


def workloads(data: Path, seconds: float = SECONDS) -> dict[str, list[RequestSpec]]:
    out = {}
    for name, (file, qps) in TRACES.items():
        specs = window(read_trace(data / "traces" / file), 0.0, seconds)
        out[name] = scale_to_qps(specs, qps) if qps else specs
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-traces", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"))
    parser.add_argument("--data", type=Path, default=nightjar_data.ROOT, help=DATA_HELP)
    parser.add_argument("--seeds", type=int, default=3, help="seeds 1..N per cell")
    parser.add_argument(
        "--seconds", type=float, default=SECONDS, help="how much of each trace, from its start"
    )
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.seconds <= 0:
        parser.error("--seeds must be >= 1 and --seconds > 0")
    profiles = builtin_profiles(args.data / "calibration")
    specs = workloads(args.data, args.seconds)
    from tqdm import tqdm  # the `sim` extra, as in `make bench`

    with tempfile.TemporaryDirectory(prefix="nightjar-bench-traces-") as scratch:
        assets = {name: ProfileAssets.build(p, Path(scratch)) for name, p in profiles.items()}
        config = BenchConfig(
            args.data,
            list(range(1, args.seeds + 1)),
            quick=False,
            assets=assets,
            only=tuple(POLICIES),
        )
        cells: dict[tuple[str, str, str], list[Cell]] = {}
        # Requests too long for a profile's KV cache (refused, the same for every policy).
        refused: dict[tuple[str, str], int] = {}
        runs = [
            (pn, w, policy, seed)
            for pn in profiles
            for w in specs
            for policy in POLICIES
            for seed in config.seeds
        ]
        for profile_name, workload, policy, seed in tqdm(runs, unit="run", desc="bench-traces"):
            result = simulate(
                profiles[profile_name], specs[workload], policy, config, seed, workload
            )
            cell = summarise(profile_name, workload, policy, result)
            refused[(profile_name, workload)] = result.rejected
            cells.setdefault((profile_name, workload, policy), []).append(cell)
    write_section(args.out, SECTION, render(cells, list(profiles), specs, config, refused))
    print(f"report: {args.out}", file=sys.stderr)
    return 0


def render(
    cells: dict[tuple[str, str, str], list[Cell]],
    profiles: list[str],
    specs: dict[str, list[RequestSpec]],
    config: BenchConfig,
    refused: dict[tuple[str, str], int],
) -> str:
    names = list(specs)
    refusals = "; ".join(
        f"`{workload}` on {profile}: {refused[(profile, workload)]}"
        for profile in profiles
        for workload in names
        if refused.get((profile, workload))
    )
    described = ", ".join(
        f"`{name}` ({len(specs[name])} requests, "
        f"{len(specs[name]) / max(specs[name][-1].arrival_s, 1e-9):.1f} req/s)"
        for name in names
    )
    lines = [
        "## Serving simulator: traces the policies were not tuned on (`make bench-traces`)",
        "",
        f"Simulated {datetime.date.today().isoformat()} by `make bench-traces` "
        f"(`benchmarks/sim_traces.py`), seeds {config.seeds}, the same simulator, "
        f"profiles, policies and settings as `make bench` (Γmax = {GAMMA_MAX}, `chat-sps` "
        "acceptance, chunked prefill). The start of each trace: "
        f"{described}. `azure-code` is the Azure code trace rescaled to 4 req/s, as "
        "`make bench` replays the conv trace; `mooncake-conv` is Moonshot AI's Mooncake "
        "conversation trace at its own rate (data/README.md). A request whose prompt and "
        "output do not fit a profile's KV cache is refused at arrival, as vLLM refuses one "
        f"longer than the model's context: {refusals or 'none'}.",
        "",
    ]
    lines += cell_tables(cells, profiles, names, config.policies)
    lines += targets(cells, profiles, names, config)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
