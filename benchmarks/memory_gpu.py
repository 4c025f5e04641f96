"""`make bench-memory-gpu`: the elastic-memory paths on a CUDA GPU.

Needs only torch (with CUDA), Triton and this repository — no vLLM, no transformers, no
download: KV buffers and draft models are random tensors shaped like real ones.

1. KV migration: the Triton kernel (`nightjar_kernels.kv_migrate`) moving blocks of
   vLLM-shaped KV buffers (both layout families, sorted and random moves) against torch's
   gather/scatter and a plain copy of the same bytes (the bandwidth ceiling); every row
   checks a sample of its moves bit for bit first.
2. Draft weights in memory of their own (`memory_agent/draft_weights.py`): offload (copy
   to pinned host memory, fingerprint, release), reload dispatch (what the engine's step
   waits for) against completion, verification, and matrix products on the main stream
   while a reload is in flight.
3. Draft weights in the KV buffer's top blocks (`memory_agent/draft_slot.py`): settle,
   hand-over, reload into the same addresses after KV data was written over them, and
   emptying the slot with the planner and the kernel.

``--json`` keeps the raw results; ``--render`` writes the report section from such a file
(measured on another machine); ``--smoke`` runs tiny sizes on CPU (Triton interpreted) to
check the script itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

SECTION = "bench-memory-gpu"
DTYPE = torch.bfloat16
CHECKED_MOVES = 32  # moves per row compared bit for bit before timing


@dataclasses.dataclass(frozen=True, slots=True)
class KVShape:
    """One model's KV cache in vLLM: a page is one layer's K and V of one block."""

    model: str
    layers: int
    kv_heads: int
    head_dim: int
    block_tokens: int = 16

    @property
    def page_numel(self) -> int:
        return 2 * self.block_tokens * self.kv_heads * self.head_dim


@dataclasses.dataclass(frozen=True, slots=True)
class DraftShape:
    """A decoder's weight shapes (Llama / Qwen2 naming); ``tied``: LM head = embedding."""

    model: str
    vocab: int
    hidden: int
    layers: int
    intermediate: int
    q_dim: int
    kv_dim: int
    qkv_bias: bool
    tied: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    kv: list[tuple[KVShape, tuple[int, ...]]]
    drafts: list[DraftShape]
    slot_kv: KVShape  # the target whose KV buffer holds the draft
    warmup: int
    reps: int
    cycles: int
    matmul: int  # side of the bf16 products that stand in for the engine's steps


LLAMA3_8B = KVShape("Llama-3-8B", layers=32, kv_heads=8, head_dim=128)
QWEN2_05B = KVShape("Qwen2-0.5B", layers=24, kv_heads=2, head_dim=64)
FULL = Plan(
    # 50k moves of Llama-3-8B's 2 MiB blocks need a 200 GiB buffer: not on one GPU.
    kv=[(LLAMA3_8B, (1_000, 10_000)), (QWEN2_05B, (1_000, 10_000, 50_000))],
    drafts=[
        DraftShape("Llama-68M", 32_000, 768, 2, 3072, 768, 768, qkv_bias=False, tied=False),
        DraftShape("Qwen2-0.5B", 151_936, 896, 24, 4864, 896, 128, qkv_bias=True, tied=True),
    ],
    slot_kv=LLAMA3_8B,
    warmup=3,
    reps=10,
    cycles=5,
    matmul=4096,
)
SMOKE = Plan(
    kv=[(KVShape("tiny", 2, 1, 8, block_tokens=2), (8, 40))],
    drafts=[DraftShape("tiny", 256, 32, 2, 64, 32, 16, qkv_bias=True, tied=True)],
    slot_kv=KVShape("tiny", 2, 1, 8, block_tokens=2),
    warmup=1,
    reps=2,
    cycles=2,
    matmul=64,
)


# --- timing -------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(action: Callable[[], object], device: torch.device, plan: Plan) -> float:
    """Median device time of ``action`` (CUDA events) after warm-up; host time on CPU."""
    for _ in range(plan.warmup):
        action()
    sync(device)
    times = []
    for _ in range(plan.reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            action()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            action()
            times.append(1e3 * (time.perf_counter() - began))
    return float(statistics.median(times))


def wall_ms(action: Callable[[], object], device: torch.device) -> float:
    """Host time of ``action`` until the device has finished it."""
    sync(device)
    began = time.perf_counter()
    action()
    sync(device)
    return 1e3 * (time.perf_counter() - began)


# --- 1. KV migration ----------------------------------------------------------------


def move_sets(pattern: str, moves: int, blocks: int, gen: torch.Generator) -> tuple[Any, Any]:
    """(src, dst) block ids: ``sorted`` empties the top ``moves`` blocks into the lowest
    free ids, in order (a compaction); ``random`` pairs random distinct blocks."""
    if pattern == "sorted":
        src = torch.arange(blocks - moves, blocks)
        low = torch.randperm(blocks - moves - 1, generator=gen)[:moves] + 1  # block 0: null
        return src, low.sort().values
    ids = torch.randperm(blocks - 1, generator=gen)[: 2 * moves] + 1
    return ids[:moves], ids[moves:]


def kv_rows(plan: Plan, device: torch.device) -> list[dict[str, Any]]:
    from nightjar_kernels.kv_migrate import KVLayout

    rows: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(0)
    for shape, sizes in plan.kv:
        blocks = 2 * max(sizes) + 16
        page = shape.page_numel
        flat = torch.empty(shape.layers * blocks * page, dtype=DTYPE, device=device).normal_()
        layouts = {
            "layer-outermost": KVLayout(shape.layers, blocks, page, blocks * page, page),
            "block-outermost": KVLayout(shape.layers, blocks, page, page, shape.layers * page),
        }
        for layout_name, layout in layouts.items():
            for pattern in ("sorted", "random"):
                for moves in sizes:
                    src, dst = move_sets(pattern, moves, blocks, gen)
                    row = {"model": shape.model, "layers": shape.layers,
                           "page_bytes": page * flat.element_size(), "layout": layout_name,
                           "pattern": pattern, "moves": moves, "checked": CHECKED_MOVES,
                           **_time_moves(flat, layout, src, dst, plan)}  # fmt: skip
                    rows.append(row)
                    print(_kv_line(row), file=sys.stderr, flush=True)
        del flat
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _time_moves(
    flat: torch.Tensor, layout: Any, src_ids: torch.Tensor, dst_ids: torch.Tensor, plan: Plan
) -> dict[str, Any]:
    """Check, then time one wave of moves by every method (bytes, ms per method, and the
    agent's whole call)."""
    from nightjar_kernels.kv_migrate import launch, migrate

    device = flat.device
    src, dst = src_ids.to(device), dst_ids.to(device)
    _check_kernel(flat, layout, src, dst)
    pages = layout.pages(flat)
    n = src.numel() * layout.num_layers * layout.page_numel  # elements read (and written)

    def per_layer() -> None:
        for layer in range(layout.num_layers):
            view = pages[layer]
            view.index_copy_(0, dst, view.index_select(0, src))

    def all_layers() -> None:
        pages[:, dst] = pages[:, src]

    def ceiling() -> None:
        flat[n : 2 * n].copy_(flat[:n])

    methods: dict[str, Callable[[], object]] = {
        "triton_1024": lambda: launch(flat, layout, src, dst, 1024),
        "triton_4096": lambda: launch(flat, layout, src, dst, 4096),
        "torch_per_layer": per_layer,
        "torch_all_layers": all_layers,
        "copy": ceiling,
    }
    ms = {name: _or_oom(lambda a=action: median_ms(a, device, plan))  # type: ignore[misc]
          for name, action in methods.items()}  # fmt: skip
    wave = list(zip(src_ids.tolist(), dst_ids.tolist(), strict=True))
    api = [wall_ms(lambda: migrate(flat, layout, [wave]), device)
           for _ in range(max(plan.reps // 2, 1))]  # fmt: skip
    return {"bytes": 2 * n * flat.element_size(), "ms": ms, "api_ms": statistics.median(api)}


def _or_oom(timed: Callable[[], float]) -> float | None:
    """A method that needs more memory than is left (torch's gather makes a copy of every
    moved page) is reported as such instead of ending the benchmark."""
    try:
        return timed()
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def _check_kernel(flat: torch.Tensor, layout: Any, src: torch.Tensor, dst: torch.Tensor) -> None:
    """A sample of the moves, destinations poisoned first, compared bit for bit."""
    from nightjar_kernels.kv_migrate import launch

    pages = layout.pages(flat)
    pick = torch.randperm(src.numel(), device=src.device)[:CHECKED_MOVES]
    expected = pages[:, src[pick]].clone()
    pages[:, dst[pick]] = -7.0
    launch(flat, layout, src, dst)
    moved = pages[:, dst[pick]]
    if not torch.equal(moved.view(torch.int16), expected.view(torch.int16)):
        raise AssertionError(f"kernel moved wrong bytes ({layout})")


def _kv_line(row: dict[str, Any]) -> str:
    rates = {k: _gbs(row["bytes"], v) for k, v in row["ms"].items()}
    return (f"{row['model']} {row['layout']} {row['pattern']} {row['moves']}: "
            + ", ".join(f"{k} {v} GB/s" for k, v in rates.items())
            + f", migrate() {row['api_ms']:.2f} ms")  # fmt: skip


# --- 2./3. draft weights ------------------------------------------------------------


def build_draft(shape: DraftShape, device: torch.device) -> torch.nn.Module:
    """Random weights with the model's tensor shapes (not a runnable model: only the
    bytes an offload moves matter here)."""

    def linear(inputs: int, outputs: int, bias: bool = False) -> torch.nn.Linear:
        return torch.nn.Linear(inputs, outputs, bias=bias, device=device, dtype=DTYPE)

    def norm() -> torch.nn.RMSNorm:
        return torch.nn.RMSNorm(shape.hidden, device=device, dtype=DTYPE)

    h, bias = shape.hidden, shape.qkv_bias
    model = torch.nn.Module()
    model.embed_tokens = torch.nn.Embedding(shape.vocab, h, device=device, dtype=DTYPE)
    model.layers = torch.nn.ModuleList(
        torch.nn.ModuleDict({
            "q_proj": linear(h, shape.q_dim, bias), "k_proj": linear(h, shape.kv_dim, bias),
            "v_proj": linear(h, shape.kv_dim, bias), "o_proj": linear(shape.q_dim, h),
            "gate_proj": linear(h, shape.intermediate), "up_proj": linear(h, shape.intermediate),
            "down_proj": linear(shape.intermediate, h),
            "input_layernorm": norm(), "post_attention_layernorm": norm(),
        })
        for _ in range(shape.layers)
    )  # fmt: skip
    model.norm = norm()
    if shape.tied:
        model.lm_head = torch.nn.Linear(h, shape.vocab, bias=False, device="meta")
        model.lm_head.weight = model.embed_tokens.weight
    else:
        model.lm_head = linear(h, shape.vocab)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02)  # no constant (all-ones) tensors
    return model


def _steps_ms(device: torch.device, steps: int, side: int) -> Callable[[], float]:
    """Matrix products on the current stream standing in for the engine's steps; the
    returned function enqueues them and gives their device time once they are done."""
    a = torch.randn(side, side, dtype=DTYPE, device=device)
    out = torch.empty_like(a)

    def run() -> float:
        if device.type != "cuda":
            return wall_ms(lambda: [torch.mm(a, a, out=out) for _ in range(steps)], device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            torch.mm(a, a, out=out)
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))

    return run


def _reload_cycle(weights: Any, device: torch.device,
                  between: Callable[[], object] = lambda: None) -> dict[str, float]:  # fmt: skip
    """offload → (between) → reload dispatch → completion → verify, timed."""
    offload = weights.offload()
    between()
    sync(device)
    began = time.perf_counter()
    start = weights.start_reload()
    sync(device)
    complete = time.perf_counter() - began
    finish = weights.finish_reload()
    return {"offload_ms": 1e3 * offload.call_seconds, "dispatch_ms": 1e3 * start.call_seconds,
            "complete_ms": 1e3 * complete, "verify_ms": 1e3 * finish.call_seconds}  # fmt: skip


def _steps_during_reload(weights: Any, steps: Callable[[], float]) -> float:
    """Device time of the stand-in steps queued right after a reload's dispatch."""
    weights.offload()
    weights.start_reload()
    stepped = steps()
    weights.finish_reload()
    return stepped


def _medians(cycles: Sequence[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(c[key] for c in cycles) for key in cycles[0]}


def draft_rows(plan: Plan, device: torch.device) -> list[dict[str, Any]]:
    from memory_agent.draft_weights import DraftWeights

    rows = []
    steps_per_reload = 100
    steps = _steps_ms(device, steps_per_reload, plan.matmul)
    for shape in plan.drafts:
        model = build_draft(shape, device)
        weights = DraftWeights(model)
        first = weights.offload()
        weights.start_reload()
        weights.finish_reload()
        cycles = [_reload_cycle(weights, device) for _ in range(plan.cycles)]
        alone = statistics.median(steps() for _ in range(plan.cycles))
        during = statistics.median(_steps_during_reload(weights, steps)
                                   for _ in range(plan.cycles))  # fmt: skip
        row = {"model": shape.model, "tensors": len(weights.movable_tensors()),
               "bytes": weights.nbytes, "first_offload_ms": 1e3 * first.call_seconds,
               "steps": steps_per_reload, "matmul": plan.matmul, "steps_alone_ms": alone,
               "steps_during_ms": during, **_medians(cycles)}  # fmt: skip
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
        del weights, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def slot_rows(plan: Plan, device: torch.device) -> list[dict[str, Any]]:
    rows = []
    for draft in plan.drafts:
        rows.append(_slot_row(draft, plan.slot_kv, plan, device))
        print(rows[-1], file=sys.stderr, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _slot_row(
    draft: DraftShape, shape: KVShape, plan: Plan, device: torch.device
) -> dict[str, Any]:
    from nightjar_kernels.kv_migrate import KVLayout, migrate

    from memory_agent import draft_slot
    from memory_agent.draft_weights import DraftWeights
    from memory_agent.planner import plan_compaction

    weights = DraftWeights(build_draft(draft, device))
    sizes = [t.numel() * t.element_size() for t in weights.movable_tensors().values()]
    page = shape.page_numel
    block_bytes = shape.layers * page * DTYPE.itemsize
    # Room for the slot (packing may take a little more than the bytes) and as many free
    # blocks below it, where emptying the slot moves its blocks.
    blocks = 2 * -(-int(sum(sizes) * 1.25) // block_bytes) + 16
    layout = KVLayout(shape.layers, blocks, page, page, shape.layers * page)
    flat = torch.empty(shape.layers * blocks * page, dtype=DTYPE, device=device).normal_()
    weights.offload()
    homed = draft_slot.home_views(weights.host_tensors(), [(flat, layout)], blocks, blocks - 1)
    assert homed is not None, "the draft does not fit the bench's KV buffer"
    slot, views = homed
    settle = weights.settle(views)
    addresses = [t.data_ptr() for t in weights.movable_tensors().values()]

    def kv_writes() -> None:
        layout.pages(flat)[:, blocks - slot :].normal_()

    cycles = [_reload_cycle(weights, device, kv_writes) for _ in range(plan.cycles)]
    same = [t.data_ptr() for t in weights.movable_tensors().values()] == addresses
    # Emptying the slot before a reload: its blocks all live, moved below it.
    tables = {"r": list(range(blocks - slot, blocks))}
    empty_ms = wall_ms(lambda: migrate(flat, layout, plan_compaction(tables, blocks - slot).waves),
                       device)  # fmt: skip
    # Layer-outermost (vLLM's default): one range per layer; and the start-up rule
    # (vllm_worker.slot_bytes), which sizes for that worst case before the buffer exists.
    pages = [page * DTYPE.itemsize] * shape.layers
    layer_outermost = draft_slot.blocks_needed(sizes, pages, 1 << 22)
    limit = -(-int(sum(sizes) * (1 + draft_slot.MAX_WASTE)) // block_bytes) + 1
    return {"model": draft.model, "kv_model": shape.model, "bytes": sum(sizes),
            "largest": max(sizes), "block_bytes": block_bytes, "slot_blocks": slot,
            "settle_ms": 1e3 * settle.call_seconds, "same_addresses": same,
            "empty_slot_ms": empty_ms, "layer_outermost_blocks": layer_outermost,
            "startup_blocks": draft_slot.blocks_needed(sizes, pages, limit),
            **_medians(cycles)}  # fmt: skip


# --- environment, report ------------------------------------------------------------


def environment(device: torch.device) -> dict[str, Any]:
    import triton

    env: dict[str, Any] = {"torch": torch.__version__, "triton": triton.__version__,
                           "python": platform.python_version(), "host": _cpu()}  # fmt: skip
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, sms=props.multi_processor_count,
                   memory_gib=props.total_memory / 2**30, cuda=torch.version.cuda,
                   driver=_driver())  # fmt: skip
    return env


def _cpu() -> str:
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")),
                platform.processor() or "unknown CPU")  # fmt: skip
    return f"{name}, {os.cpu_count()} cores"


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def measure(plan: Plan, device: torch.device, keep: Path | None = None) -> dict[str, Any]:
    """Every part; a part that fails is recorded with its error, the others still run.
    ``keep``: the results so far are written there after each part."""
    results: dict[str, Any] = {"date": datetime.date.today().isoformat(),
                               "env": environment(device), "warmup": plan.warmup,
                               "reps": plan.reps, "cycles": plan.cycles, "errors": {}}  # fmt: skip
    parts = {"kv": kv_rows, "draft": draft_rows, "slot": slot_rows}
    for name, part in parts.items():
        try:
            results[name] = part(plan, device)
        except Exception as error:  # keep what the other parts measure
            traceback.print_exc()
            results[name] = []
            results["errors"][name] = f"{type(error).__name__}: {error}"
        if keep is not None:
            keep.write_text(json.dumps(results, indent=1))
    return results


def _gbs(nbytes: float, ms: float | None) -> str:
    return "out of memory" if ms is None else f"{nbytes / ms / 1e6:,.0f}"


def _products(results: dict[str, Any]) -> str:
    rows = results["draft"]
    side = rows[0]["matmul"] if rows else 0
    return f"{rows[0]['steps'] if rows else 0} bf16 products {side}×{side}×{side}"


def render(results: dict[str, Any]) -> str:
    env = results["env"]
    gpu = (f"{env['gpu']} ({env['memory_gib']:.0f} GiB, {env['sms']} SMs), driver "
           f"{env['driver']}, CUDA {env['cuda']}" if "gpu" in env else "CPU only")  # fmt: skip
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
    for r in results["kv"]:
        ms = r["ms"]
        lines.append(
            f"| {r['model']} ({r['layers']} × {r['page_bytes'] >> 10} KiB) | {r['layout']} "
            f"| {r['moves']:,} | {r['pattern']} | {r['bytes'] / 1e9:.2f} "
            f"| {_gbs(r['bytes'], ms['triton_1024'])} | {_gbs(r['bytes'], ms['triton_4096'])} "
            f"| {_gbs(r['bytes'], ms['torch_per_layer'])} "
            f"| {_gbs(r['bytes'], ms['torch_all_layers'])} | {_gbs(r['bytes'], ms['copy'])} "
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
    for r in results["draft"]:
        lines.append(
            f"| {r['model']} | {r['tensors']} | {r['bytes'] / 1e9:.2f} "
            f"| {r['first_offload_ms']:.0f} | {r['offload_ms']:.0f} | {r['dispatch_ms']:.1f} "
            f"| {r['complete_ms']:.1f} ({_gbs(r['bytes'], r['complete_ms'])}) "
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
    for r in results["slot"]:
        lb = r["layer_outermost_blocks"]
        need = (f"{lb:,} blocks ({lb * r['block_bytes'] / 1e9:.1f} GB)" if lb is not None
                else "does not fit")  # fmt: skip
        startup = (f"{r['startup_blocks']} blocks" if r["startup_blocks"] is not None
                   else "declined (draft keeps its own memory)")  # fmt: skip
        lines.append(
            f"| {r['model']} in {r['kv_model']} ({r['block_bytes'] >> 20} MiB blocks) "
            f"| {r['slot_blocks']} ({r['slot_blocks'] * r['block_bytes'] / 1e9:.2f}) "
            f"| {r['settle_ms']:.0f} | {r['offload_ms']:.3f} | {r['dispatch_ms']:.1f} "
            f"| {r['complete_ms']:.1f} ({_gbs(r['bytes'], r['complete_ms'])}) "
            f"| {r['verify_ms']:.1f} | {'yes' if r['same_addresses'] else '**no**'} "
            f"| {r['empty_slot_ms']:.1f} | {need} | {startup} |"
        )
    for part, error in results["errors"].items():
        lines += ["", f"**{part} failed:** `{error}`"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.report import write_section

    doc = (__doc__ or "").splitlines()[0]
    parser = argparse.ArgumentParser(prog="bench-memory-gpu", description=doc)
    parser.add_argument("--out", type=Path, help="report to write the section into")
    parser.add_argument("--json", type=Path, help="also keep the raw results here")
    parser.add_argument("--render", type=Path, help="render this JSON instead of measuring")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, CPU allowed")
    args = parser.parse_args(argv)
    if args.render:
        results = json.loads(args.render.read_text())
    else:
        if args.smoke:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        elif not torch.cuda.is_available():
            parser.error("no CUDA device: this benchmark measures the GPU paths (--smoke: CPU)")
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        results = measure(SMOKE if args.smoke else FULL, device, args.json)
    text = render(results)
    print(text)
    if args.out:
        write_section(args.out, SECTION, text)
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
