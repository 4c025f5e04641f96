"""Move KV-cache blocks by a mapping, across all layers: a Triton kernel and a torch reference.

vLLM ≥ 0.28 keeps every layer's KV pages in one backing buffer: the page of layer l,
block b starts at ``l·layer_stride + b·block_stride`` (elements) and is ``page_numel``
contiguous elements (K and V together). Layer-outermost layouts (LBNHC, LBHNC) have
``layer_stride = num_blocks·page``, ``block_stride = page``; block-outermost ones
(BLNHC, …) have ``block_stride = num_layers·page``, ``layer_stride = page``. One kernel
serves both through the strides.

The kernel runs one program per move; each program walks the layers and copies the
page in ``BLOCK``-element vectors. A launch copies one *wave* of a
:class:`memory_agent.planner.MigrationPlan` — no block in a wave is both read and
written — so programs never race; waves are launched in order on one stream.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import torch

Move = tuple[int, int]


@dataclasses.dataclass(frozen=True, slots=True)
class KVLayout:
    """Where each (layer, block) page lives in a flat KV buffer, in elements."""

    num_layers: int
    num_blocks: int
    page_numel: int
    layer_stride: int
    block_stride: int

    @classmethod
    def layer_outermost(cls, cache: torch.Tensor) -> KVLayout:
        """``cache`` shaped [layers, blocks, *page] (contiguous)."""
        layers, blocks = cache.shape[:2]
        page = cache[0, 0].numel()
        return cls(layers, blocks, page, layer_stride=blocks * page, block_stride=page)

    @classmethod
    def block_outermost(cls, cache: torch.Tensor) -> KVLayout:
        """``cache`` shaped [blocks, layers, *page] (contiguous)."""
        blocks, layers = cache.shape[:2]
        page = cache[0, 0].numel()
        return cls(layers, blocks, page, layer_stride=page, block_stride=layers * page)

    def pages(self, flat: torch.Tensor) -> torch.Tensor:
        """A [layers, blocks, page] view of the flat buffer."""
        return flat.as_strided(
            (self.num_layers, self.num_blocks, self.page_numel),
            (self.layer_stride, self.block_stride, 1),
        )


def _check(cache: torch.Tensor, layout: KVLayout, moves: Sequence[Move]) -> None:
    if not cache.is_contiguous():
        raise ValueError("the KV buffer must be contiguous")
    if cache.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.uint8):
        raise ValueError(f"unsupported KV dtype {cache.dtype} (fp8 caches: pass a uint8 view)")
    for src, dst in moves:
        if not (0 <= src < layout.num_blocks and 0 <= dst < layout.num_blocks):
            raise ValueError(f"move {src}->{dst} outside 0..{layout.num_blocks - 1}")


def migrate_reference(cache: torch.Tensor, layout: KVLayout, wave: Sequence[Move]) -> None:
    """One wave of copies with torch indexing (reads all sources before writing)."""
    _check(cache, layout, wave)
    if not wave:
        return
    pages = layout.pages(cache.view(-1))
    src = torch.tensor([s for s, _ in wave], device=cache.device)
    dst = torch.tensor([d for _, d in wave], device=cache.device)
    # Advanced indexing already gathers into a new tensor: no extra copy is needed.
    pages[:, dst] = pages[:, src]


def triton_available(cache: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors, or anywhere under its interpreter (TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return bool(cache.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def migrate(
    cache: torch.Tensor, layout: KVLayout, waves: Sequence[Sequence[Move]], block: int = 1024
) -> str:
    """Execute a plan's waves in order; returns the backend used ("triton" or "torch")."""
    use_triton = triton_available(cache)
    for wave in waves:
        if use_triton:
            migrate_triton(cache, layout, wave, block)
        else:
            migrate_reference(cache, layout, wave)
    return "triton" if use_triton else "torch"


def migrate_triton(
    cache: torch.Tensor, layout: KVLayout, wave: Sequence[Move], block: int = 1024
) -> None:
    """One wave of copies with the Triton kernel, one program per move."""
    _check(cache, layout, wave)
    if not wave:
        return
    src = torch.tensor([s for s, _ in wave], dtype=torch.int64, device=cache.device)
    dst = torch.tensor([d for _, d in wave], dtype=torch.int64, device=cache.device)
    launch(cache, layout, src, dst, block)


def launch(
    cache: torch.Tensor, layout: KVLayout, src: torch.Tensor, dst: torch.Tensor, block: int = 1024
) -> None:
    """The kernel alone, for one wave whose block ids are already int64 tensors on the
    cache's device (unchecked: :func:`migrate_triton` validates a wave first)."""
    _kernel()[(src.numel(),)](
        cache.view(-1),
        src,
        dst,
        layout.num_layers,
        layout.layer_stride,
        layout.block_stride,
        layout.page_numel,
        BLOCK=block,
    )


_KERNEL: Any = None


def _kernel() -> Any:
    """Build the kernel on first use, so importing this module never needs Triton."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    # No annotations but tl.constexpr: Triton's compiler resolves each annotation as a
    # global of the kernel, and a typing name such as Any fails to compile. The two loop
    # bounds are compile-time constants (one binary per layout; an engine has one or
    # two): Triton 3.6's interpreter turns a runtime loop bound into a one-element array,
    # which numpy >= 2.5 refuses to convert to an int.
    def migrate_blocks_kernel(  # type: ignore[no-untyped-def]
        buf,
        src_ids,
        dst_ids,
        num_layers: tl.constexpr,
        layer_stride,
        block_stride,
        page_numel: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        move = tl.program_id(0)
        src = tl.load(src_ids + move).to(tl.int64) * block_stride
        dst = tl.load(dst_ids + move).to(tl.int64) * block_stride
        offsets = tl.arange(0, BLOCK)
        for layer in range(num_layers):
            # 64-bit offsets: layers × layer stride passes 2^31 elements on large caches.
            base = tl.full((), layer, tl.int64) * layer_stride
            for start in range(0, page_numel, BLOCK):
                index = start + offsets
                mask = index < page_numel
                values = tl.load(buf + base + src + index, mask=mask)
                tl.store(buf + base + dst + index, values, mask=mask)

    _KERNEL = triton.jit(migrate_blocks_kernel)
    return _KERNEL
