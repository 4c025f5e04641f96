"""vLLM's KV buffer in virtual memory, so the draft's memory can go under its top blocks.

vLLM allocates the KV cache once, as one int8 ``torch.zeros`` backing buffer that every
layer views (``allocate_kv_cache``, vLLM ≥ 0.28), and lets the model runner run that
allocation inside a context manager (``initialize_kv_cache(...,
kv_cache_allocation_context=...)``). :class:`KVAllocation` is such a context: a
``TorchFunctionMode`` that answers exactly that ``torch.zeros`` call with a view over an
:class:`ElasticMemory`'s KV range, created at that moment (nothing is reserved if vLLM
never makes the call). Where the buffer's pages lie comes from vLLM's own placement
(``KVCacheConfig.kv_cache_tensors``), before the buffer exists.

The draft's weights are evicted to host memory before the buffer is created and settled
into the elastic memory's draft range after it (:class:`ElasticDraft`), so the device
never holds them twice; CUDA graphs are captured later, with both ranges' addresses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from memory_agent.draft_weights import DraftWeights
from memory_agent.elastic_draft import draft_range_bytes
from memory_agent.vmm import SCRATCH_GRANULES, Driver, ElasticMemory
from memory_agent.vmm_plan import ElasticPlan, KVGeometry, PageRun, plan_elastic

log = logging.getLogger(__name__)

# On a host, mmap maps any multiple of the page size: small granules lose less to rounding
# in every layer's region (a CPU test engine's draft is a few MiB).
HOST_GRANULE = 64 << 10


def available(device: torch.device) -> str:
    """Why this engine cannot put its KV cache in virtual memory ("" when it can)."""
    if device.type == "cpu":
        return ""
    if device.type != "cuda":
        return f"no virtual memory driver for {device.type} devices"
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return "NVIDIA's cuda-bindings are not installed (pip install 'nightjar-sidecar[gpu]')"
    return ""


def make_driver(device: torch.device) -> Driver:
    if device.type == "cuda":
        from memory_agent.vmm_cuda import CudaDriver

        return CudaDriver(device)
    from memory_agent.vmm_host import HostDriver

    return HostDriver(HOST_GRANULE)


def _page_bytes(config: Any, layer: str) -> int | None:
    from vllm.v1.kv_cache_interface import iter_layer_specs

    for group in config.kv_cache_groups:
        if layer in group.layer_names:
            specs = getattr(group.kv_cache_spec, "kv_cache_specs", None)
            spec = specs[layer] if specs else next(iter(iter_layer_specs(group.kv_cache_spec)))
            return int(spec.page_size_bytes) if spec.has_layer_views else None
    return None


def geometry(config: Any) -> KVGeometry | None:
    """Where every layer's page of every block lies in vLLM's backing buffer (from its
    ``KVCacheConfig``); None for placements this does not cover (several backing sizes,
    layers without per-layer views such as Mamba state, pools of other block counts)."""
    tensors = list(config.kv_cache_tensors)
    if not tensors or len({t.size for t in tensors}) != 1:
        return None
    runs: KVGeometry | None = None
    for tensor in tensors:
        page = _page_bytes(config, tensor.layers[0])
        blocks = config.num_blocks_of(tensor) if hasattr(config, "num_blocks_of") else None
        if page is None or blocks not in (None, config.num_blocks):
            return None
        placed = KVGeometry.strided(
            tensor.size,
            config.num_blocks,
            len(tensor.layers),
            tensor.layer_stride,
            tensor.block_stride,
            page,
            getattr(tensor, "offset", 0),
        )
        runs = placed if runs is None else runs.merged(placed)
    return runs


def sizing_bytes(weights: DraftWeights, page_bytes: list[int], kv_bytes: int, granule: int) -> int:
    """Memory to report on top of ``kv_bytes`` for the KV buffer: what the draft's chunks
    will back under the top blocks, less the scratch and rounding the elastic memory holds
    besides (estimated for a layer-outermost buffer of that size, the costlier layout)."""
    block = sum(page_bytes)
    if not block:
        return 0
    draft = draft_range_bytes(weights)
    blocks = max(2, (kv_bytes + draft) // block)
    layers, offset = [], 0
    for page in page_bytes:
        layers.append(PageRun(offset, page, page))
        offset += blocks * page
    plan = plan_elastic(KVGeometry(offset, blocks, tuple(layers)), granule, draft)
    longest = max((length for _, length in plan.swap_runs), default=0)
    scratch = 2 * min(longest, SCRATCH_GRANULES) * granule  # a bound: scratch_pieces
    return max(0, plan.gained_bytes - scratch - granule)


class KVAllocation(TorchFunctionMode):  # type: ignore[misc]
    """While active, vLLM's KV backing allocation (``torch.zeros(size, dtype=torch.int8)``)
    is a zeroed view over a new :class:`ElasticMemory`'s KV range."""

    def __init__(self, size: int, build: Callable[[], ElasticMemory]) -> None:
        super().__init__()
        self.size = size
        self.build = build
        self.memory: ElasticMemory | None = None

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        size = args[0] if args else kwargs.get("size")
        if (
            func is torch.zeros
            and self.memory is None
            and kwargs.get("dtype") is torch.int8
            and size == self.size
        ):
            self.memory = self.build()
            buffer = self.memory.kv_tensor()[: self.size].view(torch.int8)
            buffer.zero_()
            return buffer
        return func(*args, **kwargs)


def plan_for(config: Any, weights: DraftWeights, driver: Driver) -> ElasticPlan | None:
    """The elastic plan for this KV placement and draft; None when it gains nothing."""
    placement = geometry(config)
    if placement is None:
        return None
    plan = plan_elastic(placement, driver.granularity, draft_range_bytes(weights))
    return plan if plan.top_blocks else None


def inside(memory: ElasticMemory, caches: list[torch.Tensor]) -> bool:
    """Every cache view lies in the elastic memory's KV range (vLLM used the buffer)."""
    low, high = memory.kv_address, memory.kv_address + memory.kv_nbytes
    return bool(caches) and all(low <= view.data_ptr() < high for view in caches)
