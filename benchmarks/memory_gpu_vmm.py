"""Part 4 of `make bench-memory-gpu`: the draft's memory under the KV buffer's top blocks
through virtual memory (`memory_agent/vmm*.py`, `memory_agent/elastic_draft.py`).

For a Llama-3-8B-shaped KV buffer (bf16, layer-outermost as vLLM's default, and
block-outermost) and each draft shape: the plan (top blocks withheld and gained, granules
moved, map calls), settling the draft into its range, then cycles of offload → KV written
over the gained blocks → compaction of all of them (planner + Triton kernel) → reload
(remap, copy from the pinned host copy, verify). Each cycle replays two CUDA graphs
captured before the first — one reading every weight of the draft, one reading KV through
a block table — and compares them bit for bit; free device memory is read after the first
and the last cycle, and again after the memory is closed.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.memory_gpu_drafts import build_draft
from benchmarks.memory_gpu_plan import DTYPE, DraftShape, KVShape, Plan, sync

LAYOUTS = ("layer-outermost", "block-outermost")


def _free(device: torch.device) -> int:
    sync(device)
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info(device)[0])


def _graph(device: torch.device, action: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    if device.type != "cuda":
        return action
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        action()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = action()

    def replay() -> torch.Tensor:
        graph.replay()
        return out.clone()

    replay.graph = graph  # type: ignore[attr-defined]
    return replay


def _driver(device: torch.device) -> Any:
    if device.type == "cuda":
        from memory_agent.vmm_cuda import CudaDriver

        return CudaDriver(device)
    from memory_agent.vmm_host import HostDriver

    return HostDriver(4 << 10)


def vmm_rows(plan: Plan, device: torch.device) -> list[dict[str, Any]]:
    rows = []
    for layout in LAYOUTS:
        drafts = plan.drafts if layout == LAYOUTS[0] else plan.drafts[-1:]
        for shape in drafts:
            with torch.no_grad():
                row = _row(plan, device, plan.slot_kv, shape, layout)
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    return rows


def _row(
    plan: Plan, device: torch.device, kv_shape: KVShape, shape: DraftShape, layout: str
) -> dict[str, Any]:
    from nightjar_kernels.kv_migrate import KVLayout, migrate

    from memory_agent.draft_weights import DraftWeights
    from memory_agent.elastic_draft import ElasticDraft, draft_range_bytes
    from memory_agent.planner import plan_compaction
    from memory_agent.vmm import ElasticMemory
    from memory_agent.vmm_plan import KVGeometry, plan_elastic

    free_before = _free(device)
    page = kv_shape.page_numel * DTYPE.itemsize
    blocks, layers = plan.vmm_blocks, kv_shape.layers
    outer = layout == LAYOUTS[0]
    geometry = KVGeometry.strided(
        layers * blocks * page,
        blocks,
        layers,
        layer_stride=blocks * page if outer else page,
        block_stride=page if outer else layers * page,
        page_bytes=page,
    )
    model = build_draft(shape, device)
    weights = DraftWeights(model)
    draft_bytes = weights.nbytes
    driver = _driver(device)
    began = time.perf_counter()
    elastic_plan = plan_elastic(geometry, driver.granularity, draft_range_bytes(weights))
    plan_ms = 1e3 * (time.perf_counter() - began)
    began = time.perf_counter()
    memory = ElasticMemory(driver, elastic_plan)
    reserve_ms = 1e3 * (time.perf_counter() - began)
    began = time.perf_counter()
    draft = ElasticDraft(weights, memory)
    sync(device)
    settle_ms = 1e3 * (time.perf_counter() - began)

    flat = memory.kv_tensor()[: geometry.nbytes].view(DTYPE)
    kv_layout = (
        KVLayout(
            layers, blocks, kv_shape.page_numel, blocks * kv_shape.page_numel, kv_shape.page_numel
        )
        if outer
        else KVLayout(
            layers, blocks, kv_shape.page_numel, kv_shape.page_numel, layers * kv_shape.page_numel
        )
    )
    pages = kv_layout.pages(flat)
    top = elastic_plan.top_blocks
    keep = blocks - top
    pages[:, :keep] = 1  # stands in for live KV below the gained blocks
    table = torch.randint(1, max(2, keep - top - 1), (8, 32), device=device)
    params = list(model.parameters())
    read_draft = _graph(device, lambda: torch.stack([p.float().sum() for p in params]))
    read_kv = _graph(device, lambda: pages[:, table].float().sum(dim=(0, -1)))
    expected = (read_draft(), read_kv())

    # Compaction before a reload: every gained block is live and moves below ``keep``.
    tables = {"all": list(range(keep, blocks))}
    waves = plan_compaction(tables, keep, reserved=range(keep - top)).waves
    cycles: list[dict[str, float]] = []
    identical = True
    free_first = 0
    for cycle in range(plan.vmm_cycles):
        sync(device)
        began = time.perf_counter()
        offload = draft.offload()
        offload_ms = 1e3 * (time.perf_counter() - began)
        pages[:, keep:] = 2  # KV written over the draft's memory
        sync(device)
        began = time.perf_counter()
        migrate(flat, kv_layout, waves)
        sync(device)
        compact_ms = 1e3 * (time.perf_counter() - began)
        began = time.perf_counter()
        draft.start_reload()
        dispatch = time.perf_counter() - began
        finish = draft.finish_reload()
        complete = time.perf_counter() - began
        identical &= torch.equal(read_draft(), expected[0]) and torch.equal(read_kv(), expected[1])
        cycles.append(
            {
                "offload_ms": offload_ms,
                "compact_ms": compact_ms,
                "dispatch_us": 1e6 * dispatch,
                "complete_ms": 1e3 * complete,
                "verify_ms": 1e3 * finish.call_seconds,
            }
        )
        del offload
        if cycle == 0:
            free_first = _free(device)
    free_last = _free(device)
    physical, swap_calls = memory.physical_bytes, memory.calls_per_move
    del read_draft, read_kv
    memory.close()
    del draft, weights, model, memory
    free_after = _free(device)
    timings = {key: statistics.median(c[key] for c in cycles) for key in cycles[0]}
    return {
        "kv": kv_shape.model,
        "layout": layout,
        "draft": shape.model,
        "draft_bytes": draft_bytes,
        "draft_range_bytes": elastic_plan.draft_granules * elastic_plan.granule,
        "granule": elastic_plan.granule,
        "kv_blocks": blocks,
        "block_bytes": layers * page,
        "top_blocks": top,
        "gained_bytes": elastic_plan.gained_bytes,
        "runs": len(elastic_plan.swap_runs),
        "calls_per_move": swap_calls,
        "plan_ms": plan_ms,
        "reserve_ms": reserve_ms,
        "settle_ms": settle_ms,
        "cycles": plan.vmm_cycles,
        "identical": identical,
        "free_first_cycle": free_first,
        "free_last_cycle": free_last,
        "physical_bytes": physical,
        "free_before": free_before,
        "free_after_close": free_after,
        **timings,
    }
