"""`nightjar-sim`: replay your own trace against candidate policies before deploying.

    nightjar-sim my_trace.csv --qps 6 --policies goodput,nightjar,off,static-1,ema,oracle
    nightjar-sim my_trace.jsonl --sidecar unix:/run/nightjar/nightjar.sock   # + a live sidecar

The trace is an Azure-format CSV (TIMESTAMP, ContextTokens, GeneratedTokens) or a generic
CSV/JSONL with a timestamp and input/output token counts (see workload.py). Every policy
replays the same requests on the chosen hardware profile; `--sidecar` adds a run whose
γ comes from a running sidecar through the plugin's client (whatever policy it serves).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import nightjar_data

from policy_server.sim.engine import SimResult, Simulator
from policy_server.sim.profile import builtin_profiles
from policy_server.sim.runs import (
    DATA_HELP,
    POLICIES,
    POPULATIONS,
    TABLE_MODE,
    BenchConfig,
    Cell,
    ProfileAssets,
    simulate,
    summarise,
    summary_table,
)
from policy_server.sim.sources import ClientSource
from policy_server.sim.workload import RequestSpec, TraceError, read_trace, scale_to_qps, window

DEFAULT_POLICIES = "goodput,nightjar,off,static-1,static-3,table,ema,dsd,oracle"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nightjar-sim", description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="CSV or JSONL trace")
    parser.add_argument("--start", type=float, default=0.0, help="slice start, trace seconds")
    parser.add_argument("--seconds", type=float, help="slice length, trace seconds (all)")
    parser.add_argument("--qps", type=float, help="rescale arrivals to this mean rate")
    parser.add_argument(
        "--profile",
        default="llama2-7b-a100",
        help="hardware profile: llama2-7b-a100 or llama2-70b-h100-tp4",
    )
    parser.add_argument(
        "--acceptance",
        default="chat-sps",
        choices=sorted(POPULATIONS),
        help="acceptance of the draft/target pair: one model, or a mix of request categories",
    )
    parser.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help=f"comma-separated, from: {', '.join([*POLICIES, *TABLE_MODE])}",
    )
    parser.add_argument("--sidecar", help="also replay with γ from this sidecar (unix:PATH)")
    parser.add_argument("--no-chunked-prefill", dest="chunked_prefill", action="store_false")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--data",
        type=Path,
        default=nightjar_data.ROOT,
        help=DATA_HELP,
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    return parser.parse_args(argv)


def load_requests(args: argparse.Namespace) -> list[RequestSpec]:
    specs = read_trace(args.trace)
    if args.start or args.seconds:
        specs = window(specs, args.start, args.seconds or float("inf"))
    if not specs:
        raise TraceError(f"{args.trace}: no requests in the selected slice")
    return scale_to_qps(specs, args.qps) if args.qps else specs


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES and p not in TABLE_MODE]
    profiles = builtin_profiles(args.data / "calibration")
    if unknown or args.profile not in profiles:
        bad = unknown or [args.profile]
        print(f"nightjar-sim: unknown policy or profile {bad}", file=sys.stderr)
        return 2
    try:
        specs = load_requests(args)
    except TraceError as exc:
        print(f"nightjar-sim: {exc}", file=sys.stderr)
        return 2
    profile = profiles[args.profile]
    print(
        f"{len(specs)} requests over {specs[-1].arrival_s:.0f} s on {args.profile}", file=sys.stderr
    )
    results: dict[str, SimResult] = {}
    with tempfile.TemporaryDirectory(prefix="nightjar-sim-") as scratch:
        assets = ProfileAssets.build(profile, Path(scratch))
        bench = BenchConfig(
            args.data,
            [args.seed],
            quick=False,
            chunked_prefill=args.chunked_prefill,
            acceptance=args.acceptance,
            assets={args.profile: assets},
        )
        for policy in policies:
            results[policy] = simulate(profile, specs, policy, bench, args.seed)
    if args.sidecar:
        with ClientSource.connect(args.sidecar, "nightjar-sim") as client:
            source = ClientSource(client)
            sim = Simulator(
                profile, POPULATIONS[args.acceptance], specs, source, bench.sim(args.seed)
            )
            results["sidecar"] = sim.run()
        print(
            f"sidecar: {source.steps} steps decided, {source.signalled} sent per-request "
            f"signals, {source.planned} ran per-request γ; {client.stats.tables} tables, "
            f"{client.stats.fallbacks_total} fallbacks",
            file=sys.stderr,
        )
    cells: dict[str, Cell] = {
        name: summarise(args.profile, str(args.trace), name, result)
        for name, result in results.items()
    }
    reference = "oracle" if "oracle" in cells else next(iter(cells))
    print("\n".join(summary_table(cells, reference)))
    if args.json:
        args.json.write_text(json.dumps({name: vars(c) for name, c in cells.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
