"""The section of docs/BENCHMARKS.md that `make bench-memory-gpu` writes, from its results.

Its results are JSON (`--json` keeps them), so the section can be rendered on another
machine than the one that measured (`--render`).
"""

from __future__ import annotations

from typing import Any

from benchmarks.memory_gpu_plan import CHECKED_MOVES


def gbs(nbytes: float, ms: float | None) -> str:
    return "out of memory" if ms is None else f"{nbytes / ms / 1e6:,.0f}"


def _products(results: dict[str, Any]) -> str:
    rows = results.get("draft", [])
    side = rows[0]["matmul"] if rows else 0
    return f"{rows[0]['steps'] if rows else 0} bf16 products {side}×{side}×{side}"


def render(results: dict[str, Any]) -> str:
    env = results["env"]
    gpu = (
        f"{env['gpu']} ({env['memory_gib']:.0f} GiB, {env['sms']} SMs), driver "
        f"{env['driver']}, CUDA {env['cuda']}"
        if "gpu" in env
        else "CPU only"
    )
    lines = [
        "## Elastic memory on a GPU (`make bench-memory-gpu`)",
        "",
        f"Measured {results['date']} on {gpu}; torch {env['torch']}, Triton {env['triton']}, "
        f"Python {env['python']}; host {env['host']}. By `make bench-memory-gpu` "
        "(`benchmarks/memory_gpu.py`): random tensors shaped like real KV caches and drafts, "
        "bf16; nothing downloaded.",
        "",
        "### KV block migration",
        "",
        "One launch moves every listed block in every layer. GB/s counts bytes read plus "
        "bytes written (2 × moves × layers × page), 10⁹ bytes; device time by CUDA events, "
        f"median of {results['reps']} after {results['warmup']} warm-ups. *sorted*: the top "
        "M blocks into the lowest free ids, in order (a compaction); *random*: M random "
        "disjoint (source, destination) pairs. "
        "Triton B = elements per vector step of the kernel (`block`, default 1024); torch "
        "per layer = `index_select` + `index_copy_` on each layer's view; torch all layers = "
        "one gather/scatter over the [layers, blocks, page] view (the fallback "
        "`migrate_reference`); `copy_` = one contiguous copy of the same bytes, the "
        "ceiling. `migrate()` = the agent's call for one wave (Python list of moves in, "
        "checks, index upload, kernel), host time to completion. Before timing, each row "
        f"checks {CHECKED_MOVES} of its moves bit for bit (destinations poisoned first).",
        "",
        "| KV (page) | layout | moves | pattern | GB moved | Triton B=1024 GB/s "
        "| Triton B=4096 GB/s | torch per layer GB/s | torch all layers GB/s | `copy_` GB/s "
        "| `migrate()` ms |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results.get("kv", []):
        ms = r["ms"]
        lines.append(
            f"| {r['model']} ({r['layers']} × {r['page_bytes'] >> 10} KiB) | {r['layout']} "
            f"| {r['moves']:,} | {r['pattern']} | {r['bytes'] / 1e9:.2f} "
            f"| {gbs(r['bytes'], ms['triton_1024'])} | {gbs(r['bytes'], ms['triton_4096'])} "
            f"| {gbs(r['bytes'], ms['torch_per_layer'])} "
            f"| {gbs(r['bytes'], ms['torch_all_layers'])} | {gbs(r['bytes'], ms['copy'])} "
            f"| {r['api_ms']:.2f} |"
        )
    lines += [
        "",
        "### Draft weights in memory of their own",
        "",
        "`DraftWeights` on the GPU: the first offload (fingerprints, pinned host buffers "
        "allocated, device → host copy, release), then the median of "
        f"{results['cycles']} cycles of offload (fingerprints; the kept host copy serves "
        "again, as the weights did not change; release) → reload. Dispatch = what the "
        "calling thread (the engine's step) waits for: "
        "allocation and non-blocking copies queued on a side stream; complete = until the "
        "copies are done; verify = `finish_reload` (fingerprints on the device). While each "
        f"reload is in flight the main stream runs {_products(results)}, timed against the "
        "same products alone.",
        "",
        "| draft (shapes) | tensors | GB | first offload ms | offload ms | reload dispatch ms "
        "| reload complete ms (GB/s) | verify ms | products alone / during reload ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results.get("draft", []):
        lines.append(
            f"| {r['model']} | {r['tensors']} | {r['bytes'] / 1e9:.2f} "
            f"| {r['first_offload_ms']:.0f} | {r['offload_ms']:.0f} | {r['dispatch_ms']:.1f} "
            f"| {r['complete_ms']:.1f} ({gbs(r['bytes'], r['complete_ms'])}) "
            f"| {r['verify_ms']:.1f} | {r['steps_alone_ms']:.1f} / {r['steps_during_ms']:.1f} |"
        )
    lines += [
        "",
        "### Draft weights in the KV buffer's top blocks",
        "",
        "The same drafts settled (`DraftWeights.settle`) into the top blocks of a "
        "block-outermost KV buffer shaped like the target's. Median of "
        f"{results['cycles']} cycles: offload "
        "hands the blocks over (no copy); KV data is written over the whole slot; reload "
        "writes the host copy back into the same bytes; verify. *Empty the slot* = "
        "`plan_compaction` + `migrate()` of all the slot's blocks (all live) to lower ids, "
        "what precedes a reload. Layer-outermost (vLLM's default) needs one gap-free range "
        "per layer for each tensor: the blocks it would take are computed "
        "(`draft_slot.blocks_needed`), and vLLM start-up (`vllm_worker.slot_bytes`) sizes "
        "the slot for that case before the buffer exists, declining above the draft's bytes "
        "+ 10 % + 1 block.",
        "",
        "| draft in KV of | slot blocks (GB) | settle ms | offload ms | reload dispatch ms "
        "| reload complete ms (GB/s) | verify ms | same addresses | empty the slot ms "
        "| layer-outermost would need | start-up sizing |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in results.get("slot", []):
        lb = r["layer_outermost_blocks"]
        need = (
            f"{lb:,} blocks ({lb * r['block_bytes'] / 1e9:.1f} GB)"
            if lb is not None
            else "does not fit"
        )
        startup = (
            f"{r['startup_blocks']} blocks"
            if r["startup_blocks"] is not None
            else "declined (draft keeps its own memory)"
        )
        lines.append(
            f"| {r['model']} in {r['kv_model']} ({r['block_bytes'] >> 20} MiB blocks) "
            f"| {r['slot_blocks']} ({r['slot_blocks'] * r['block_bytes'] / 1e9:.2f}) "
            f"| {r['settle_ms']:.0f} | {r['offload_ms']:.3f} | {r['dispatch_ms']:.1f} "
            f"| {r['complete_ms']:.1f} ({gbs(r['bytes'], r['complete_ms'])}) "
            f"| {r['verify_ms']:.1f} | {'yes' if r['same_addresses'] else '**no**'} "
            f"| {r['empty_slot_ms']:.1f} | {need} | {startup} |"
        )
    lines += _vmm(results)
    for part, error in results["errors"].items():
        lines += ["", f"**{part} failed:** `{error}`"]
    return "\n".join(lines)


def _vmm(results: dict[str, Any]) -> list[str]:
    rows = results.get("vmm", [])
    if not rows:
        return []
    lines = [
        "",
        "### The draft's memory under the KV buffer's top blocks (CUDA virtual memory)",
        "",
        "`memory_agent/vmm*.py`, `memory_agent/elastic_draft.py`: the KV buffer and the "
        "draft's weights in reserved address ranges; an offload maps the draft's physical "
        "chunks under the top blocks of every layer's region (`vmm_plan.plan_elastic`), a "
        "reload maps them back and copies the pinned host copy in. Per row: the KV buffer "
        f"({rows[0]['kv_blocks']:,} blocks), the draft settled into its range, then "
        f"{rows[0]['cycles']} cycles of offload → KV written over the gained blocks → "
        "compaction of all of them (planner + Triton kernel) → reload (dispatch: the call "
        "that remaps and queues the copies; complete: until verified). *Graphs identical*: "
        "a CUDA graph reading every weight and one reading KV through a block table, "
        "captured before the first cycle, replayed after each, bit for bit. *Free memory*: "
        "device free memory after the first and the last cycle; *before → after*: free "
        "memory before the row's buffers existed and after the elastic memory was closed "
        "(the first row also loads CUDA libraries and kernels). Medians over the cycles.",
        "",
        "| KV layout | draft (bytes) | blocks gained (bytes) | runs · calls per move "
        "| settle ms | offload ms | reload dispatch µs | reload complete ms | verify ms "
        "| compaction ms | graphs identical | free memory first → last cycle "
        "| before → after (GiB) |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in rows:
        gained = r["top_blocks"] * r["block_bytes"]
        lines.append(
            f"| {r['kv']} {r['layout']} | {r['draft']} ({r['draft_bytes'] / 1e9:.3f} GB) "
            f"| {r['top_blocks']:,} ({gained / 1e9:.3f} GB; "
            f"{r['gained_bytes'] / 1e9:.3f} GB of granules) "
            f"| {r['runs']} · {r['calls_per_move']} | {r['settle_ms']:.0f} "
            f"| {r['offload_ms']:.2f} | {r['dispatch_us']:,.0f} | {r['complete_ms']:.1f} "
            f"| {r['verify_ms']:.1f} | {r['compact_ms']:.2f} "
            f"| {'yes' if r['identical'] else '**no**'} "
            f"| {r['free_first_cycle'] / 2**30:.3f} → {r['free_last_cycle'] / 2**30:.3f} GiB "
            f"| {r['free_before'] / 2**30:.3f} → {r['free_after_close'] / 2**30:.3f} |"
        )
    return lines
