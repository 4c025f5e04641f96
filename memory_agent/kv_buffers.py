"""Find the KV buffers behind an engine's per-layer cache views, for the migration kernel.

vLLM gives each attention layer a ``[blocks, ...]`` view into one backing allocation; the
views of a layer-outermost layout sit one ``layer_stride`` apart, those of a
block-outermost layout one page apart inside a block. Views that share a storage, a
dtype, a shape and strides and are evenly spaced become one :class:`KVLayout` over a
flat buffer, so one kernel launch moves a block in every layer; anything else (an odd
layer, a cache with another page size) gets a layout of its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from nightjar_kernels.kv_migrate import KVLayout

Buffer = tuple[torch.Tensor, KVLayout]


def _dense(tensor: torch.Tensor) -> bool:
    """The elements fill one gap-free range of memory, in any dimension order (a layout
    such as LBNHC gives [H, N, C] block views that are dense but not contiguous)."""
    expected = 1
    dims = zip(tensor.stride(), tensor.shape, strict=True)
    for stride, size in sorted((st, n) for st, n in dims if n > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _page_numel(view: torch.Tensor) -> int | None:
    """Elements of one block's page when they fill one range of memory, else None."""
    if view.dim() < 2 or not _dense(view[0]):
        return None
    page = view[0].numel()
    return page if view.stride(0) >= page else None


def _flat(view: torch.Tensor, offset: int, numel: int) -> torch.Tensor:
    return view.as_strided((numel,), (1,), storage_offset=offset)


def kv_buffers(caches: Sequence[torch.Tensor]) -> list[Buffer]:
    """(flat buffer, layout) pairs covering every distinct cache view exactly once."""
    groups: dict[tuple[object, ...], list[torch.Tensor]] = {}
    seen: set[tuple[torch.device, int]] = set()
    for view in caches:
        if view.element_size() == 1 and view.dtype != torch.uint8:
            view = view.view(torch.uint8)  # fp8 caches: the kernel moves bytes
        key = (view.device, view.data_ptr())
        if key in seen:  # layers that share their KV alias one view
            continue
        seen.add(key)
        page = _page_numel(view)
        if page is None:
            raise ValueError(f"KV cache view {tuple(view.shape)} has no contiguous block pages")
        group = (
            view.device,
            view.untyped_storage().data_ptr(),
            view.dtype,
            tuple(view.shape),
            view.stride(),
        )
        groups.setdefault(group, []).append(view)
    buffers: list[Buffer] = []
    for views in groups.values():
        views.sort(key=lambda v: v.storage_offset())
        offsets = [v.storage_offset() for v in views]
        steps = {b - a for a, b in itertools.pairwise(offsets)}
        first = views[0]
        blocks, page, block_stride = first.shape[0], _page_numel(first) or 0, first.stride(0)
        layer_stride = min(steps) if steps else 0
        if len(steps) <= 1 and (len(views) == 1 or layer_stride >= page):
            layout = KVLayout(len(views), blocks, page, layer_stride, block_stride)
            span = (len(views) - 1) * layer_stride + (blocks - 1) * block_stride + page
            buffers.append((_flat(first, offsets[0], span), layout))
            continue
        for view, offset in zip(views, offsets, strict=True):
            span = (blocks - 1) * block_stride + page
            buffers.append((_flat(view, offset, span), KVLayout(1, blocks, page, 0, block_stride)))
    return buffers
