"""Part 1 of `make bench-memory-gpu`: KV block migration on the GPU.

The Triton kernel (`nightjar_kernels.kv_migrate`) moving blocks of vLLM-shaped KV buffers
(both layout families, sorted and random moves) against torch's gather/scatter and a plain
copy of the same bytes (the bandwidth ceiling); every row checks a sample of its moves
bit for bit first.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.memory_gpu_plan import CHECKED_MOVES, DTYPE, Plan, median_ms, wall_ms
from benchmarks.memory_gpu_report import gbs


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
                    row = {
                        "model": shape.model,
                        "layers": shape.layers,
                        "page_bytes": page * flat.element_size(),
                        "layout": layout_name,
                        "pattern": pattern,
                        "moves": moves,
                        "checked": CHECKED_MOVES,
                        **_time_moves(flat, layout, src, dst, plan),
                    }
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
    ms = {
        name: _or_oom(lambda a=action: median_ms(a, device, plan))  # type: ignore[misc]
        for name, action in methods.items()
    }
    wave = list(zip(src_ids.tolist(), dst_ids.tolist(), strict=True))
    api = [
        wall_ms(lambda: migrate(flat, layout, [wave]), device)
        for _ in range(max(plan.reps // 2, 1))
    ]
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
    rates = {k: gbs(row["bytes"], v) for k, v in row["ms"].items()}
    return (
        f"{row['model']} {row['layout']} {row['pattern']} {row['moves']}: "
        + ", ".join(f"{k} {v} GB/s" for k, v in rates.items())
        + f", migrate() {row['api_ms']:.2f} ms"
    )
