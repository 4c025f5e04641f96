"""The scheduler walks `make bench-instructions` counts: a decode batch on vLLM's objects."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from benchmarks.scheduler_walks import GAMMA, decode_batch, walk
from vllm_client_patch.scheduler import batch_shape, verified_step


def test_every_request_of_the_decode_batch_drafts_and_verifies_half_its_drafts() -> None:
    batch = decode_batch(5)
    shape = batch_shape(batch.scheduled, batch.requests, True)
    assert (shape.drafting, shape.prefill_tokens) == (5, 0)
    assert shape.request_ids == tuple(batch.requests)
    request = batch.requests["request-0"]
    assert shape.context_tokens == 5 * (request.num_computed_tokens + 1 + GAMMA)
    verified = verified_step(batch.scheduled, batch.result, batch.requests, True)
    assert verified.request_accepts == (GAMMA // 2,) * 5
    assert (verified.drafted_tokens, verified.generated_tokens) == (5 * GAMMA, 5 * (1 + GAMMA // 2))
    assert verified.request_ids == shape.request_ids


def test_a_walk_leaves_the_batch_as_it_was() -> None:
    batch = decode_batch(3)
    before = batch_shape(batch.scheduled, batch.requests, True)
    walk(batch, 4)
    assert batch_shape(batch.scheduled, batch.requests, True) == before
