"""The draft's weights live in the KV buffer's top blocks, so the two really share memory.

vLLM allocates its KV buffer once and cannot resize it (docs/MEMORY.md), so "give the
draft's memory to the KV cache" is done the other way round: the buffer is allocated with
the draft's share on top (the worker reports that much more memory for KV), the draft's
weights are moved into the pages of its top S_draft blocks, and the agent withholds those
blocks from vLLM's pool while the draft is resident. Offloading the draft hands the blocks
to the pool — the weights' bytes become KV pages, nothing is copied (the host copy made at
start is kept); before a reload, compaction empties the blocks and the weights are copied
back into the same bytes. The weights' addresses never change, so CUDA graphs captured
with them stay valid.

A weight tensor needs one gap-free range. In a block-outermost layout the top blocks are
one range; in a layer-outermost layout (vLLM's default) they are one range per layer, so
a tensor larger than ``S_draft × page`` needs more blocks than its bytes: the slot is sized
by first-fit packing, and declined when that wastes too much (the agent then withholds
the draft's share of a buffer it shares with nothing, see docs/MEMORY.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import torch

from memory_agent.kv_buffers import Buffer

# Every tensor starts on a 256-byte boundary: enough for any dtype view and vector load.
ALIGN = 256
# A slot may take this much more than the draft's bytes (rounded up to blocks, plus one
# block) before it is declined (vllm_worker.slot_bytes): packing large tensors into
# per-layer pages can waste a lot.
MAX_WASTE = 0.10


@dataclasses.dataclass(frozen=True, slots=True)
class Span:
    """A gap-free byte range of a KV buffer: ``data[start : start + length]``."""

    data: torch.Tensor | None  # the buffer's bytes (None in a sizing estimate)
    start: int
    length: int

    @property
    def address(self) -> int:
        return (self.data.data_ptr() if self.data is not None else 0) + self.start


def pack(sizes: Sequence[int], spans: Sequence[Span]) -> list[tuple[int, int]] | None:
    """First-fit decreasing: (span index, byte offset in the span) for each size, each
    start aligned to :data:`ALIGN` in memory; None when they do not all fit."""
    used = [0] * len(spans)
    placed: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        for s, span in enumerate(spans):
            offset = used[s] + (-(span.address + used[s]) % ALIGN)
            if offset + sizes[index] <= span.length:
                placed[index] = (s, offset)
                used[s] = offset + sizes[index]
                break
        else:
            return None
    return placed


def tail_spans(buffers: Sequence[Buffer], first_block: int) -> list[Span]:
    """The byte ranges of blocks ``>= first_block`` in every layer, adjacent pages merged."""
    spans: list[Span] = []
    for flat, layout in buffers:
        data = flat.view(torch.uint8)
        size = flat.element_size()
        layers = np.arange(layout.num_layers, dtype=np.int64)[:, None] * layout.layer_stride
        blocks = np.arange(first_block, layout.num_blocks, dtype=np.int64) * layout.block_stride
        starts = np.sort((layers + blocks[None, :]).ravel())
        if not starts.size:
            continue
        # A new range begins wherever a page does not follow the previous one.
        breaks = np.flatnonzero(starts[1:] != starts[:-1] + layout.page_numel) + 1
        heads = np.concatenate(([0], breaks))
        tails = np.concatenate((breaks, [starts.size]))
        for head, tail in zip(heads.tolist(), tails.tolist(), strict=True):
            length = (tail - head) * layout.page_numel * size
            spans.append(Span(data, int(starts[head]) * size, length))
    return spans


def fewest_blocks(fits: Callable[[int], bool], limit: int) -> int | None:
    """The smallest block count in [1, limit] for which ``fits`` holds (it only grows
    with the count), by bisection; None if not even ``limit`` does."""
    if limit < 1 or not fits(limit):
        return None
    low, high = 1, limit
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle + 1, high)
    return low


def blocks_needed(sizes: Sequence[int], page_bytes: Sequence[int], limit: int) -> int | None:
    """For sizing, before the buffer exists: the fewest top blocks whose pages
    (``page_bytes`` per layer, one range per layer — the layer-outermost case, the worst)
    hold every tensor; None above ``limit``."""
    return fewest_blocks(
        lambda blocks: (
            pack(sizes, [Span(None, 0, blocks * page) for page in page_bytes]) is not None
        ),
        limit,
    )


def home_views(
    tensors: dict[str, torch.Tensor], buffers: Sequence[Buffer], num_blocks: int, limit: int
) -> tuple[int, dict[str, torch.Tensor]] | None:
    """(S_draft, a view for each tensor in the top S_draft blocks of the actual buffers):
    the fewest blocks (at most ``limit``) that hold them all; None if none do."""
    names = list(tensors)
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]

    def fits(blocks: int) -> bool:
        return pack(sizes, tail_spans(buffers, num_blocks - blocks)) is not None

    blocks = fewest_blocks(fits, limit)
    if blocks is None:
        return None
    spans = tail_spans(buffers, num_blocks - blocks)
    placed = pack(sizes, spans)
    assert placed is not None
    views: dict[str, torch.Tensor] = {}
    for name, size, (index, offset) in zip(names, sizes, placed, strict=True):
        span, tensor = spans[index], tensors[name]
        assert span.data is not None
        raw = span.data[span.start + offset : span.start + offset + size]
        views[name] = raw.view(tensor.dtype).view(tensor.shape)
    return blocks, views
