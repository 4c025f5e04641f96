"""What `make bench-memory-gpu` measures, and how it times it.

The KV caches and drafts it shapes tensors after (`KVShape`, `DraftShape`), the full and
the smoke plan, and the clocks: CUDA events for device time, host time until the device
has finished.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

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
    vmm_blocks: int  # blocks of the KV buffer the draft's memory goes under (part 4)
    vmm_cycles: int


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
    vmm_blocks=8192,  # 16 GiB of Llama-3-8B KV
    vmm_cycles=20,
)
SMOKE = Plan(
    kv=[(KVShape("tiny", 2, 1, 8, block_tokens=2), (8, 40))],
    drafts=[DraftShape("tiny", 256, 32, 2, 64, 32, 16, qkv_bias=True, tied=True)],
    slot_kv=KVShape("tiny", 2, 1, 8, block_tokens=2),
    warmup=1,
    reps=2,
    cycles=2,
    matmul=64,
    vmm_blocks=4096,
    vmm_cycles=2,
)


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
