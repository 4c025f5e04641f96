"""Granule accounting of the elastic KV plan, for any layout, page size and dtype."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memory_agent.vmm_plan import KVGeometry, pack_tensors, plan_elastic, swappable

KIB, MIB = 1 << 10, 1 << 20


def owners(geometry: KVGeometry, granule: int) -> list[set[int]]:
    """For each granule, the blocks with a byte in it (by brute force, byte ranges)."""
    granules = -(-geometry.nbytes // granule)
    found: list[set[int]] = [set() for _ in range(granules)]
    for run in geometry.layers:
        for block in range(geometry.num_blocks):
            start = run.offset + block * run.block_stride
            for g in range(start // granule, (start + run.page_bytes - 1) // granule + 1):
                found[g].add(block)
    return found


@st.composite
def geometries(draw: st.DrawFn) -> tuple[KVGeometry, int]:
    granule = draw(st.sampled_from([4 * KIB, 16 * KIB, 64 * KIB]))
    layers = draw(st.integers(1, 6))
    blocks = draw(st.integers(2, 60))
    # bf16/fp16 pages of 16 tokens, fp8 ones, odd sizes: any page size.
    page = draw(st.sampled_from([512, 1000, 2 * KIB, 3 * KIB, 8 * KIB, 24 * KIB]))
    offset = draw(st.sampled_from([0, 256, granule]))
    if draw(st.booleans()):  # layer-outermost: each layer a region of its own
        return KVGeometry.strided(
            offset + layers * blocks * page, blocks, layers, blocks * page, page, page, offset
        ), granule
    return KVGeometry.strided(  # block-outermost: a block is every layer's page
        offset + layers * blocks * page, blocks, layers, page, layers * page, page, offset
    ), granule


@settings(max_examples=150, deadline=None)
@given(geometries(), st.integers(1, 40))
def test_the_plan_takes_over_only_granules_of_withheld_blocks(
    case: tuple[KVGeometry, int], draft_granules: int
) -> None:
    geometry, granule = case
    plan = plan_elastic(geometry, granule, draft_granules * granule - 7)
    assert plan.draft_granules == draft_granules
    assert plan.swap_granules <= plan.draft_granules
    keep = geometry.num_blocks - plan.top_blocks
    assert keep >= 2
    by_granule = owners(geometry, granule)
    swapped = [g for start, length in plan.swap_runs for g in range(start, start + length)]
    assert swapped == sorted(set(swapped)), "runs are disjoint and in address order"
    for g in swapped:  # nothing a kept block uses changes hands, and no run is padding
        assert by_granule[g] and min(by_granule[g]) >= keep
    # The fixed runs and the swap runs tile the KV range exactly.
    tiles = sorted([*plan.swap_runs, *plan.fixed_runs()])
    assert sum(length for _, length in tiles) == plan.kv_granules
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(tiles))
    freed = [int(swappable(geometry, granule, d).sum()) for d in range(geometry.num_blocks - 1)]
    assert freed[plan.top_blocks] == plan.swap_granules
    # As many granules as the draft can back, through as few withheld blocks as free them.
    assert plan.swap_granules == max(f for f in freed if f <= draft_granules)
    assert plan.top_blocks == (freed.index(plan.swap_granules) if plan.swap_granules else 0)


def test_llama_3_8b_kv_takes_a_qwen2_half_b_draft_in_every_layer() -> None:
    """The case the draft-in-slot packing declined: 32 layer-outermost regions of 64 KiB
    pages; the draft's 0.99 GB now back 14 granules at the top of each layer."""
    page, blocks = 64 * KIB, 16384
    geometry = KVGeometry.strided(32 * blocks * page, blocks, 32, blocks * page, page, page)
    plan = plan_elastic(geometry, 2 * MIB, 988_000_000)
    assert len(plan.swap_runs) == 32
    assert {length for _, length in plan.swap_runs} == {14}
    assert plan.gained_bytes <= plan.draft_granules * 2 * MIB
    # The pool grows by about the draft's bytes: lost to rounding, under a granule a layer.
    assert plan.top_blocks * 32 * page >= 988_000_000 - 32 * 2 * MIB
    block_outermost = KVGeometry.strided(32 * blocks * page, blocks, 32, page, 32 * page, page)
    whole = plan_elastic(block_outermost, 2 * MIB, 988_000_000)
    assert len(whole.swap_runs) == 1 and whole.swap_granules == whole.draft_granules


def test_a_draft_smaller_than_a_granule_per_layer_takes_nothing() -> None:
    page, blocks = 64 * KIB, 1024
    geometry = KVGeometry.strided(32 * blocks * page, blocks, 32, blocks * page, page, page)
    plan = plan_elastic(geometry, 2 * MIB, 4 * MIB)
    assert plan.top_blocks == 0 and plan.swap_runs == () and plan.remainder_granules == 2


def test_geometry_refuses_pages_past_the_buffer_or_overlapping() -> None:
    with pytest.raises(ValueError, match="past the buffer"):
        KVGeometry.strided(1000, 4, 1, 1000, 256, 256)
    with pytest.raises(ValueError, match="overlap"):
        KVGeometry.strided(4096, 4, 1, 0, 128, 256)


def test_draft_tensors_are_packed_end_to_end_aligned() -> None:
    offsets, total = pack_tensors([10, 300, 1, 256])
    assert offsets == [0, 256, 768, 1024] and total == 1280
    assert np.all(np.asarray(offsets) % 256 == 0)
