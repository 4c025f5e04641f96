"""Parts 2 and 3 of `make bench-memory-gpu`: draft weights offloaded and reloaded.

2. In memory of their own (`memory_agent/draft_weights.py`): offload (copy to pinned host
   memory, fingerprint, release), reload dispatch against completion, verification, and
   matrix products on the main stream while a reload is in flight.
3. In the KV buffer's top blocks (`memory_agent/draft_slot.py`): settle, hand-over, reload
   into the same addresses after KV data was written over them, and emptying the slot with
   the planner and the kernel.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from benchmarks.memory_gpu_plan import DTYPE, DraftShape, KVShape, Plan, sync, wall_ms


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
        torch.nn.ModuleDict(
            {
                "q_proj": linear(h, shape.q_dim, bias),
                "k_proj": linear(h, shape.kv_dim, bias),
                "v_proj": linear(h, shape.kv_dim, bias),
                "o_proj": linear(shape.q_dim, h),
                "gate_proj": linear(h, shape.intermediate),
                "up_proj": linear(h, shape.intermediate),
                "down_proj": linear(shape.intermediate, h),
                "input_layernorm": norm(),
                "post_attention_layernorm": norm(),
            }
        )
        for _ in range(shape.layers)
    )
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


def _reload_cycle(
    weights: Any, device: torch.device, between: Callable[[], object] = lambda: None
) -> dict[str, float]:
    """offload → (between) → reload dispatch → completion → verify, timed."""
    offload = weights.offload()
    between()
    sync(device)
    began = time.perf_counter()
    start = weights.start_reload()
    sync(device)
    complete = time.perf_counter() - began
    finish = weights.finish_reload()
    return {
        "offload_ms": 1e3 * offload.call_seconds,
        "dispatch_ms": 1e3 * start.call_seconds,
        "complete_ms": 1e3 * complete,
        "verify_ms": 1e3 * finish.call_seconds,
    }


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
        during = statistics.median(_steps_during_reload(weights, steps) for _ in range(plan.cycles))
        row = {
            "model": shape.model,
            "tensors": len(weights.movable_tensors()),
            "bytes": weights.nbytes,
            "first_offload_ms": 1e3 * first.call_seconds,
            "steps": steps_per_reload,
            "matmul": plan.matmul,
            "steps_alone_ms": alone,
            "steps_during_ms": during,
            **_medians(cycles),
        }
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
    empty_ms = wall_ms(
        lambda: migrate(flat, layout, plan_compaction(tables, blocks - slot).waves), device
    )
    # Layer-outermost (vLLM's default): one range per layer; and the start-up rule
    # (vllm_worker.slot_bytes), which sizes for that worst case before the buffer exists.
    pages = [page * DTYPE.itemsize] * shape.layers
    layer_outermost = draft_slot.blocks_needed(sizes, pages, 1 << 22)
    limit = -(-int(sum(sizes) * (1 + draft_slot.MAX_WASTE)) // block_bytes) + 1
    return {
        "model": draft.model,
        "kv_model": shape.model,
        "bytes": sum(sizes),
        "largest": max(sizes),
        "block_bytes": block_bytes,
        "slot_blocks": slot,
        "settle_ms": 1e3 * settle.call_seconds,
        "same_addresses": same,
        "empty_slot_ms": empty_ms,
        "layer_outermost_blocks": layer_outermost,
        "startup_blocks": draft_slot.blocks_needed(sizes, pages, limit),
        **_medians(cycles),
    }
