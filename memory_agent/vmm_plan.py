"""Which granules of the KV buffer the draft's physical memory backs while it is offloaded.

With virtual memory management (CUDA's cuMem API, or mmap on a host) the KV buffer and the
draft's weights each live in an address range reserved once, which never moves: CUDA
graphs keep both addresses. Physical memory is mapped into those ranges in *granules*
(2 MiB on current NVIDIA GPUs). While the draft is offloaded, the physical chunks behind
its range are unmapped and mapped under the KV buffer's top blocks instead, in every
layer's region at once, so the KV pool grows by the draft's bytes whatever the layout;
a reload moves them back.

A granule of the KV buffer can change hands only if no byte of it belongs to a block that
stays in the pool while the draft is resident. :func:`plan_elastic` withholds the most
top blocks whose swappable granules the draft's chunks can back, and lays the draft's
range out as one chunk per run of consecutive swappable granules (one map call per run,
not per granule), plus the remainder that stays under the draft.

Pure arithmetic on byte offsets; nothing here touches a device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

# Each draft tensor starts on a 256-byte boundary: enough for any dtype view and vector load.
TENSOR_ALIGN = 256


@dataclasses.dataclass(frozen=True, slots=True)
class PageRun:
    """The pages of one layer: block ``b``'s page is ``page_bytes`` long and starts at
    ``offset + b * block_stride`` bytes into the KV buffer."""

    offset: int
    block_stride: int
    page_bytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class KVGeometry:
    """Where every (layer, block) page of a KV buffer lies, in bytes."""

    nbytes: int
    num_blocks: int
    layers: tuple[PageRun, ...]

    @classmethod
    def strided(
        cls,
        nbytes: int,
        num_blocks: int,
        num_layers: int,
        layer_stride: int,
        block_stride: int,
        page_bytes: int,
        offset: int = 0,
    ) -> KVGeometry:
        """vLLM's placement (``KVCacheTensor``): layer ``l``'s page of block ``b`` at
        ``offset + l * layer_stride + b * block_stride``. Layer-outermost layouts have
        ``layer_stride = num_blocks * page``, block-outermost ones ``layer_stride = page``."""
        runs = tuple(
            PageRun(offset + layer * layer_stride, block_stride, page_bytes)
            for layer in range(num_layers)
        )
        return cls(nbytes, num_blocks, runs)

    def merged(self, other: KVGeometry) -> KVGeometry:
        """Two placements in one buffer (vLLM's KV cache tensors of several cache groups)."""
        if other.num_blocks != self.num_blocks:
            raise ValueError("merged placements must index the same blocks")
        nbytes = max(self.nbytes, other.nbytes)
        return KVGeometry(nbytes, self.num_blocks, self.layers + other.layers)

    def __post_init__(self) -> None:
        if self.num_blocks < 2 or not self.layers:
            raise ValueError("a KV buffer needs at least 2 blocks and one layer")
        for run in self.layers:
            last = run.offset + (self.num_blocks - 1) * run.block_stride + run.page_bytes
            if run.offset < 0 or run.page_bytes <= 0 or run.block_stride < run.page_bytes:
                raise ValueError(f"pages overlap or are empty: {run}")
            if last > self.nbytes:
                raise ValueError(f"pages of {run} end at {last}, past the buffer's {self.nbytes}")


@dataclasses.dataclass(frozen=True, slots=True)
class ElasticPlan:
    """The outcome of :func:`plan_elastic`; granule indices count from the range's start."""

    granule: int
    kv_granules: int  # the KV buffer's range, in granules
    draft_granules: int  # the draft's range (its bytes rounded up to granules)
    top_blocks: int  # blocks withheld from the pool while the draft is resident
    # (first granule, granules) of each run of the KV range the draft's chunks back while it
    # is offloaded, in address order; the draft's range holds the same runs end to end.
    swap_runs: tuple[tuple[int, int], ...]

    @property
    def swap_granules(self) -> int:
        return sum(length for _, length in self.swap_runs)

    @property
    def gained_bytes(self) -> int:
        """Physical memory the KV buffer gains while the draft is offloaded."""
        return self.swap_granules * self.granule

    @property
    def remainder_granules(self) -> int:
        """The draft's granules that stay under its own range (rounding per run)."""
        return self.draft_granules - self.swap_granules

    def fixed_runs(self) -> list[tuple[int, int]]:
        """(first granule, granules) of the KV range that stay mapped to memory of their own."""
        runs: list[tuple[int, int]] = []
        cursor = 0
        for start, length in (*self.swap_runs, (self.kv_granules, 0)):
            if start > cursor:
                runs.append((cursor, start - cursor))
            cursor = start + length
        return runs

    def draft_offsets(self) -> list[int]:
        """Where each swap run's chunk lies in the draft's range (granules)."""
        offsets, cursor = [], 0
        for _, length in self.swap_runs:
            offsets.append(cursor)
            cursor += length
        return offsets


def _granule_cover(
    geometry: KVGeometry, granule: int, first: int, stop: int, granules: int
) -> np.ndarray:
    """Which granules hold a byte of a page of blocks ``first <= b < stop`` (any layer)."""
    blocks = np.arange(first, stop, dtype=np.int64)
    count = np.zeros(granules + 1, dtype=np.int64)
    for run in geometry.layers:
        starts = run.offset + blocks * run.block_stride
        # Mark [first, last] granule of every page at once: +1 at the first, -1 past the last.
        count += np.bincount(starts // granule, minlength=granules + 1)
        count -= np.bincount((starts + run.page_bytes - 1) // granule + 1, minlength=granules + 1)
    return np.cumsum(count[:-1]) > 0


def swappable(geometry: KVGeometry, granule: int, top_blocks: int) -> np.ndarray:
    """Granules every byte of which is free while the top ``top_blocks`` blocks are withheld:
    they hold pages of those blocks and no page of any other."""
    granules = -(-geometry.nbytes // granule)
    keep = geometry.num_blocks - top_blocks
    top = _granule_cover(geometry, granule, keep, geometry.num_blocks, granules)
    kept = _granule_cover(geometry, granule, 0, keep, granules)
    mask: np.ndarray = top & ~kept
    return mask


def _runs(mask: np.ndarray) -> tuple[tuple[int, int], ...]:
    edges = np.diff(np.concatenate(([0], mask.astype(np.int8), [0])))
    starts, stops = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return tuple((int(a), int(b - a)) for a, b in zip(starts, stops, strict=True))


def plan_elastic(
    geometry: KVGeometry, granule: int, draft_bytes: int, min_kept_blocks: int = 2
) -> ElasticPlan:
    """The top blocks whose memory the draft's chunks can take over — as many granules as
    the draft has, through as few blocks as free them (the KV pool keeps at least
    ``min_kept_blocks``) — and the runs of granules they back while offloaded."""
    if granule <= 0 or draft_bytes <= 0:
        raise ValueError("granule and draft size must be positive")
    draft_granules = -(-draft_bytes // granule)
    limit = max(0, geometry.num_blocks - min_kept_blocks)

    def freed(blocks: int) -> int:
        return int(swappable(geometry, granule, blocks).sum())

    # The granules freed only grow with the blocks withheld: bisect for the most granules
    # the draft can back, then for the fewest blocks that free that many (a block sharing a
    # granule with a kept one would be withheld for nothing).
    low, high = 0, limit
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if freed(middle) <= draft_granules else (low, middle - 1)
    most = freed(low)
    low, high = 0, low
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if freed(middle) >= most else (middle + 1, high)
    top = low if most else 0
    runs = _runs(swappable(geometry, granule, top)) if top else ()
    return ElasticPlan(
        granule=granule,
        kv_granules=-(-geometry.nbytes // granule),
        draft_granules=draft_granules,
        top_blocks=top,
        swap_runs=runs,
    )


def pack_tensors(sizes: Sequence[int], align: int = TENSOR_ALIGN) -> tuple[list[int], int]:
    """Byte offsets of tensors laid end to end in one range, each aligned; and the total."""
    offsets: list[int] = []
    cursor = 0
    for size in sizes:
        cursor += -cursor % align
        offsets.append(cursor)
        cursor += size
    return offsets, cursor
