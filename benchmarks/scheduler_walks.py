"""The scheduler hook's per-request walks on vLLM's own objects: ``batch_shape`` (as the
step is scheduled) and ``verified_step`` (as its output arrives) over a decode batch of
real ``Request``s, a real ``SchedulerOutput`` and ``ModelRunnerOutput``, the requests
named as the default's per-request policy asks (`make bench-instructions` counts them;
`benchmarks/hook_cost.py` counts the controller they feed).

The counted process imports vLLM (tens of seconds natively, many minutes under callgrind):
it starts with callgrind's instrumentation off and switches it on after the imports and
the warm-up, then has callgrind dump its counts after each walk (``callgrind_control``,
valgrind's own tool), so each walk's count is a part of its own.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from collections.abc import Sequence

from vllm import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from vllm_client_patch.scheduler import batch_shape, verified_step

# The batch's decodes: γ drafts each, half of them accepted; a context of a typical chat.
GAMMA = 3
PROMPT_TOKENS = 300
OUTPUT_TOKENS = 40
# Steps each walk runs before the counting starts (Python specialises its bytecode).
WARM_STEPS = 50


@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """One step of a decode batch as the scheduler hook sees it."""

    requests: dict[str, Request]
    scheduled: SchedulerOutput
    result: ModelRunnerOutput


def decode_request(request_id: str) -> Request:
    """A running request mid-decode: its prompt and outputs computed but the last token,
    ``GAMMA`` drafts to verify."""
    request = Request(request_id, list(range(PROMPT_TOKENS)), SamplingParams(max_tokens=512), None)
    request.append_output_token_ids(list(range(OUTPUT_TOKENS)))
    request.num_computed_tokens = request.num_tokens - 1
    request.spec_token_ids = [1] * GAMMA
    return request


def decode_batch(size: int) -> DecodeBatch:
    """``size`` decodes scheduled with their drafts, each accepting half of them."""
    requests = {f"request-{i}": decode_request(f"request-{i}") for i in range(size)}
    ids = list(requests)
    scheduled = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={i: 1 + GAMMA for i in ids},
        total_num_scheduled_tokens=(1 + GAMMA) * size,
        scheduled_spec_decode_tokens={i: list(requests[i].spec_token_ids) for i in ids},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )
    sampled = [[7] * (1 + GAMMA // 2) for _ in ids]
    result = ModelRunnerOutput(
        req_ids=ids, req_id_to_index={i: n for n, i in enumerate(ids)}, sampled_token_ids=sampled
    )
    return DecodeBatch(requests, scheduled, result)


def walk(batch: DecodeBatch, steps: int) -> None:
    """``steps`` steps of the two walks, the requests named."""
    requests, scheduled, result = batch.requests, batch.scheduled, batch.result
    for _ in range(steps):
        batch_shape(scheduled, requests, True)
        verified_step(scheduled, result, requests, True)


def _callgrind(*request: str) -> None:
    """A request to the callgrind running this process (``callgrind_control``)."""
    subprocess.run(
        ["callgrind_control", *request, str(os.getpid())], check=True, capture_output=True
    )


def counted_walks(sizes: Sequence[int], lengths: Sequence[int]) -> None:
    """The process `make bench-instructions` counts: for each batch size, a walk of each
    length, each ending in a dump of callgrind's counts (its part, in order). The part
    before the first walk is the switch's own: each walk's part then has the same
    overhead of the requests around it."""
    batches = [decode_batch(size) for size in sizes]
    for batch in batches:
        walk(batch, WARM_STEPS)
    _callgrind("--instr=on")
    _callgrind("--dump")
    for batch in batches:
        for steps in lengths:
            walk(batch, steps)
            _callgrind("--dump")
