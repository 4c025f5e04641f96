"""`make bench-memory`: how long the KV migration planner takes on large pools (CPU).

For pools of 10k, 100k and 1M blocks, half of them live and scattered over the pool in
tables of 16 blocks, contract to 60 % of the pool (`plan_compaction`), and order a random
permutation of 10 % of the pool with its cycles (`order_moves`). Best of three runs.
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from memory_agent.planner import order_moves, plan_compaction
from policy_server.bench_rpc import machine
from policy_server.report import write_section

SECTION = "bench-memory"
SIZES = (10_000, 100_000, 1_000_000)


def best_of(runs: int, action: Callable[[], object]) -> tuple[float, object]:
    times, result = [], None
    for _ in range(runs):
        started = time.perf_counter()
        result = action()
        times.append(time.perf_counter() - started)
    return min(times), result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-memory", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"))
    args = parser.parse_args(argv)
    rows = []
    for blocks in SIZES:
        rng = random.Random(blocks)
        live = rng.sample(range(1, blocks), blocks // 2)
        tables = {f"r{i}": live[i : i + 16] for i in range(0, len(live), 16)}
        k_new = int(blocks * 0.6)
        compact_s, plan = best_of(3, lambda: plan_compaction(tables, k_new))  # noqa: B023
        moved = len(plan.mapping)  # type: ignore[attr-defined]
        ids = rng.sample(range(blocks), blocks // 10)
        mapping = dict(zip(ids, rng.sample(ids, len(ids)), strict=True))
        order_s, ordered = best_of(3, lambda: order_moves(mapping, scratch=-1))  # noqa: B023
        waves = len(ordered.waves)  # type: ignore[attr-defined]
        rows.append(f"| {blocks:,} | {moved:,} | {1000 * compact_s:.1f} | {len(mapping):,} | "
                    f"{waves:,} | {1000 * order_s:.1f} |")  # fmt: skip
        print(rows[-1], file=sys.stderr)
    body = "\n".join([
        "## KV migration planner (`make bench-memory`)",
        "",
        f"Measured {datetime.date.today().isoformat()} on {machine()}, by `make bench-memory` "
        "(`memory_agent/bench.py`): pools with half their blocks live in tables of 16, "
        "compacted to 60 % of the pool; and a random permutation of 10 % of the pool "
        "(chains and cycles) ordered into parallel-safe waves. Best of 3, pure Python.",
        "",
        "| pool blocks | blocks moved | plan_compaction ms | permuted blocks | waves "
        "| order_moves ms |",
        "|---:|---:|---:|---:|---:|---:|",
        *rows,
    ])  # fmt: skip
    write_section(args.out, SECTION, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
