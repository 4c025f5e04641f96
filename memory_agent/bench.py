"""`make bench-memory`: KV migration planner on large pools; draft offload/reload (CPU).

For pools of 10k, 100k and 1M blocks, half of them live and scattered over the pool in
tables of 16 blocks, contract to 60 % of the pool (`plan_compaction`), and order a random
permutation of 10 % of the pool with its cycles (`order_moves`). Then offload and reload
(with verification) the CPU-rig draft model (tiny_models `truncated`). Best of three.
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
    parser.add_argument("--models", type=Path, default=Path("out/models/cpu-rig"))
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
    write_section(args.out, SECTION, body + "\n\n" + draft_transfers(args.models))
    return 0


def draft_transfers(models: Path) -> str:
    """Offload → reload → verify of a real (tiny) draft model's weights, on CPU."""
    from transformers import LlamaForCausalLM

    from memory_agent.draft_weights import DraftWeights
    from vllm_client_patch.tiny_models import Recipe, build

    pair = build(models, Recipe.for_kind("truncated"))
    model = LlamaForCausalLM.from_pretrained(str(pair.draft))
    weights = DraftWeights(model)
    rows: list[tuple[float, float, float]] = []
    nbytes = 0
    for _ in range(3):
        offload = weights.offload()
        start = weights.start_reload()
        finish = weights.finish_reload()
        nbytes = offload.bytes
        rows.append((offload.call_seconds, start.call_seconds, finish.call_seconds))
    best = [min(r[i] for r in rows) for i in range(3)]
    return "\n".join([
        f"Draft weights ({nbytes / 2**20:.0f} MiB fp32, the CPU-rig draft: 2 layers, hidden "
        "1024), `memory_agent/draft_weights.py`, host = device = CPU here, best of 3:",
        "",
        "| offload (copy + fingerprint + release) | reload copy | verify (fingerprints) |",
        "|---:|---:|---:|",
        f"| {1000 * best[0]:.0f} ms | {1000 * best[1]:.0f} ms | {1000 * best[2]:.0f} ms |",
        "",
        "On CUDA the reload copy is dispatched on a side stream with non-blocking copies "
        "from pinned memory; no GPU was available to measure it.",
    ])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
