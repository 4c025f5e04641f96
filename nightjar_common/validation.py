"""Input checks for step contexts, outcomes and client paths: one place, clear messages.

Everything is checked before anything is applied, so a rejected request
changes no learned state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from nightjar_common.errors import InvalidArgumentError
from nightjar_common.types import RanStep, RequestSignals, StepContext, StepOutcome

# γ is a small number of draft tokens; anything above this is a client bug.
HARD_GAMMA_LIMIT = 64
# Longest engine id and learner key the sidecar accepts.
MAX_ID_LENGTH = 256
# Longest decision id (StepOutcome.decision_id, RanStep.decision_id): the sidecar's are
# "<table_id>.<n>", a few dozen characters; a pending decision holds its id.
MAX_DECISION_ID_LENGTH = 128
# Ran steps and outcomes one request may carry (StepRequest.ran_steps, .outcomes): a
# client reports every few steps, so a few dozen; bounded so one message stays small.
MAX_BATCHED = 256
# Token counts of one step: far above any engine's (a step's tokens fit its batch and a
# few dozen drafts each), far below what overflows a learner's sums.
MAX_STEP_TOKENS = 2**31


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds that separate plausible engine data from garbage."""

    max_batch_size: int = 65536
    # The largest γ any policy accepts as gamma_max; a draft_gamma past it is garbage (the
    # engine may draft past the policy's own Γmax when its fallback table says so).
    max_gamma: int = 64
    max_step_seconds: float = 600.0
    # No engine step is shorter (a GPU kernel launch alone takes a few µs; the plugin
    # tests' fake engine, all Python, takes ~10 µs): a shorter one makes goodput absurd.
    min_step_seconds: float = 1e-6
    max_engine_id_length: int = MAX_ID_LENGTH
    # Per-request sections (StepContext.requests, StepOutcome.requests) and each
    # request's recent_accepts: bounded so one message cannot make the server hold much.
    max_requests: int = 4096
    max_recent_accepts: int = 256


def check_context(ctx: StepContext, limits: Limits) -> None:
    _check_engine_id(ctx.engine_id, limits)
    if len(ctx.learner_key) > limits.max_engine_id_length:
        raise InvalidArgumentError(
            f"learner_key is longer than {limits.max_engine_id_length} characters"
        )
    if not 1 <= ctx.batch_size <= limits.max_batch_size:
        raise InvalidArgumentError(
            f"batch_size must be in 1..{limits.max_batch_size}, got {ctx.batch_size}"
        )
    for name in (
        "num_waiting",
        "free_kv_blocks",
        "total_kv_blocks",
        "max_draft_lag_tokens",
        "context_tokens",
    ):
        if getattr(ctx, name) < 0:
            raise InvalidArgumentError(f"{name} must be >= 0, got {getattr(ctx, name)}")
    if ctx.total_kv_blocks and ctx.free_kv_blocks > ctx.total_kv_blocks:
        raise InvalidArgumentError(
            f"free_kv_blocks ({ctx.free_kv_blocks}) exceeds total_kv_blocks ({ctx.total_kv_blocks})"
        )
    if ctx.previous_gamma is not None and not 0 <= ctx.previous_gamma <= HARD_GAMMA_LIMIT:
        raise InvalidArgumentError(
            f"previous_gamma must be in 0..{HARD_GAMMA_LIMIT}, got {ctx.previous_gamma}"
        )
    if not 0 <= ctx.max_gamma <= HARD_GAMMA_LIMIT:
        raise InvalidArgumentError(f"max_gamma must be in 0..{HARD_GAMMA_LIMIT}")
    if not 0 <= ctx.min_draft_passes <= (ctx.max_gamma or HARD_GAMMA_LIMIT):
        raise InvalidArgumentError(
            f"min_draft_passes must be in 0..{ctx.max_gamma or HARD_GAMMA_LIMIT} (max_gamma, "
            f"or {HARD_GAMMA_LIMIT} when unset), got {ctx.min_draft_passes}"
        )
    if ctx.runtime is not None:
        for name in ("engine_version", "model_runner", "method"):
            if len(getattr(ctx.runtime, name)) > limits.max_engine_id_length:
                raise InvalidArgumentError(
                    f"runtime.{name} is longer than {limits.max_engine_id_length} characters"
                )
    if len(ctx.requests) > limits.max_requests:
        raise InvalidArgumentError(
            f"{len(ctx.requests)} per-request sections, more than {limits.max_requests}"
        )
    # Every request of every step passes here: no generator or name loop per request.
    for req in ctx.requests:
        accepts = req.recent_accepts
        if len(req.request_id) > limits.max_engine_id_length:
            raise InvalidArgumentError(
                f"a request_id is longer than {limits.max_engine_id_length} characters"
            )
        if len(accepts) > limits.max_recent_accepts:
            raise InvalidArgumentError(
                f"request {req.request_id!r}: more than {limits.max_recent_accepts} recent_accepts"
            )
        if req.context_tokens < 0 or (accepts and min(accepts) < 0):
            raise InvalidArgumentError(f"request {req.request_id!r}: negative token counts")
        if req.kl_divergence is not None or req.draft_entropy is not None:
            _check_distances(req)
    if ctx.requests:
        check_request_ids([req.request_id for req in ctx.requests], "the context")


def _check_distances(req: RequestSignals) -> None:
    """A request's KL divergence and draft entropy, where sent: finite and >= 0."""
    for name in ("kl_divergence", "draft_entropy"):
        value = getattr(req, name)
        if value is not None and (not math.isfinite(value) or value < 0):
            raise InvalidArgumentError(
                f"request {req.request_id!r}: {name} must be finite and >= 0, got {value}"
            )


def _check_decision_id(decision_id: str) -> None:
    if len(decision_id) > MAX_DECISION_ID_LENGTH:
        raise InvalidArgumentError(
            f"decision_id {decision_id[:32]!r}... has {len(decision_id):,} characters, more "
            f"than the {MAX_DECISION_ID_LENGTH} of any decision id the sidecar issues"
        )


def check_outcome(outcome: StepOutcome, limits: Limits) -> None:
    """Checks that need no knowledge of the decision (see check_outcome_against)."""
    if not outcome.decision_id:
        raise InvalidArgumentError("decision_id is required in a step outcome")
    _check_decision_id(outcome.decision_id)
    _check_engine_id(outcome.engine_id, limits)
    seconds = outcome.step_seconds
    if not math.isfinite(seconds) or not (
        limits.min_step_seconds <= seconds <= limits.max_step_seconds
    ):
        raise InvalidArgumentError(
            f"step_seconds must be finite and in [{limits.min_step_seconds}, "
            f"{limits.max_step_seconds}], got {seconds}"
        )
    for name in ("generated_tokens", "drafted_tokens", "accepted_tokens", "prefill_tokens"):
        if not 0 <= getattr(outcome, name) <= MAX_STEP_TOKENS:
            raise InvalidArgumentError(
                f"{name} must be in 0..{MAX_STEP_TOKENS}, got {getattr(outcome, name)} "
                "(negative goodput, or more tokens than any step has)"
            )
    if outcome.draft_gamma is not None and not 0 <= outcome.draft_gamma <= limits.max_gamma:
        raise InvalidArgumentError(
            f"draft_gamma must be in 0..{limits.max_gamma}, got {outcome.draft_gamma}"
        )
    if outcome.accepted_tokens > outcome.drafted_tokens:
        raise InvalidArgumentError(
            f"accepted_tokens ({outcome.accepted_tokens}) exceeds drafted_tokens "
            f"({outcome.drafted_tokens})"
        )
    if not math.isfinite(outcome.goodput):
        raise InvalidArgumentError("goodput (generated_tokens / step_seconds) is not finite")
    if len(outcome.request_accepts) > limits.max_requests:
        raise InvalidArgumentError(
            f"{len(outcome.request_accepts)} per-request sections, more than {limits.max_requests}"
        )
    accepts = outcome.request_accepts
    if accepts and not 0 <= min(accepts) <= max(accepts) <= outcome.gamma:
        raise InvalidArgumentError(
            f"per-request accepted_tokens must be in 0..gamma ({outcome.gamma}): a request "
            "accepts at most the drafts it verified"
        )
    if sum(outcome.request_accepts) > outcome.accepted_tokens:
        raise InvalidArgumentError(
            f"per-request accepted_tokens sum to {sum(outcome.request_accepts)}, more than "
            f"the step's accepted_tokens ({outcome.accepted_tokens})"
        )
    if outcome.request_ids and len(outcome.request_ids) != len(outcome.request_accepts):
        raise InvalidArgumentError(
            f"{len(outcome.request_ids)} request ids for {len(outcome.request_accepts)} "
            "per-request accepted counts"
        )
    if max(map(len, outcome.request_ids), default=0) > limits.max_engine_id_length:
        raise InvalidArgumentError(
            f"a request_id is longer than {limits.max_engine_id_length} characters"
        )
    if outcome.request_ids:
        check_request_ids(outcome.request_ids, f"the outcome of {outcome.decision_id}")


# What a request id must not hold: ids are logged, kept as keys of learned state and written
# to line-based files, where a NUL or a line break passes for the end of a string or record.
_BREAKING_CHARACTERS = ("\0", "\n", "\r")


def check_request_ids(ids: Sequence[str], where: str) -> None:
    """The request ids of one step (its context's or its outcome's): each names one request
    of the batch once, and none holds a NUL or a line break (INVALID_ARGUMENT)."""
    joined = "".join(ids)  # one scan of all ids, not a loop per request
    if any(character in joined for character in _BREAKING_CHARACTERS):
        bad = next(i for i in ids if any(c in i for c in _BREAKING_CHARACTERS))
        raise InvalidArgumentError(
            f"request id {bad[:64]!r} in {where} holds a NUL or a line break"
        )
    if len(set(ids)) != len(ids):
        raise InvalidArgumentError(
            f"request id {_first_repeated(ids)[:64]!r} appears more than once in {where}: "
            "a step's requests are distinct"
        )


def _first_repeated(ids: Sequence[str]) -> str:
    seen: set[str] = set()
    for request_id in ids:
        if request_id in seen:
            return request_id
        seen.add(request_id)
    raise ValueError("no id is repeated")


def check_batch_size(ran_steps: Sequence[RanStep], outcomes: Sequence[StepOutcome]) -> None:
    for name, items in (("ran_steps", ran_steps), ("outcomes", outcomes)):
        if len(items) > MAX_BATCHED:
            raise InvalidArgumentError(f"{len(items)} {name}, more than {MAX_BATCHED}")


def check_ran_step(step: RanStep, engine_id: str, limits: Limits) -> None:
    """A step run from a table, of ``engine_id`` (the request's: a batch is applied under
    that engine's lock)."""
    _check_decision_id(step.decision_id)
    table_id, dot, number = step.decision_id.rpartition(".")
    if not table_id or not dot or not number.isdigit():
        raise InvalidArgumentError(
            f"ran step decision_id {step.decision_id!r} is not '<table_id>.<n>'"
        )
    check_context(step.context, limits)
    if step.context.engine_id != engine_id:
        raise InvalidArgumentError(
            f"ran step {step.decision_id} is of engine {step.context.engine_id!r}, "
            f"not the request's {engine_id!r}"
        )
    if not 0 <= step.gamma <= limits.max_gamma:
        raise InvalidArgumentError(
            f"ran step {step.decision_id}: gamma must be in 0..{limits.max_gamma}, got {step.gamma}"
        )


def check_batched_outcome(outcome: StepOutcome, engine_id: str, limits: Limits) -> None:
    """An outcome of a report batch, of ``engine_id`` (the request's)."""
    check_outcome(outcome, limits)
    if outcome.engine_id != engine_id:
        raise InvalidArgumentError(
            f"outcome of {outcome.decision_id} is of engine {outcome.engine_id!r}, "
            f"not the request's {engine_id!r}"
        )


def check_outcome_against(
    outcome: StepOutcome, decided: StepContext, gamma_max: int, limits: Limits
) -> None:
    """Checks against the decision the outcome answers (its context ``decided`` and the
    deciding policy's Γmax): nothing learns from an outcome its decision makes impossible."""
    if outcome.engine_id != decided.engine_id:
        raise InvalidArgumentError(
            f"decision {outcome.decision_id} was made for engine {decided.engine_id!r}, "
            f"not {outcome.engine_id!r}"
        )
    if not 0 <= outcome.gamma <= gamma_max:
        raise InvalidArgumentError(
            f"gamma must be in 0..{gamma_max} (the deciding policy's Γmax), got {outcome.gamma}"
        )
    _check_plausible(outcome, decided.batch_size, limits)


def _check_plausible(outcome: StepOutcome, batch_size: int, limits: Limits) -> None:
    """Token counts a step of ``batch_size`` requests at the outcome's γ can produce.

    Only bounds a real engine never crosses. The decision's batch is the requests that
    drafted before the step; in the step some may be aborted (vLLM's plugin counts only
    requests that sampled) and a request reaching its stop or max_tokens keeps fewer
    tokens than it accepted (the simulator counts those), so generated may fall below the
    batch size and below the accepted drafts; requests whose prefill completes in the
    step sample a token each without being in the batch (at most a batch's worth more).
    What always holds: every request that verified drafts sampled at least one token.
    """
    # The drafts verified were proposed at the decision's γ; with draft_gamma the engine
    # may have drafted at the next one's (the larger bounds either).
    gamma = max(outcome.gamma, outcome.drafted_gamma)
    if outcome.drafted_tokens > gamma * batch_size:
        raise InvalidArgumentError(
            f"drafted_tokens ({outcome.drafted_tokens}) exceeds gamma ({gamma}) times the "
            f"decision's batch size ({batch_size})"
        )
    floor = len(outcome.request_accepts) or int(outcome.drafted_tokens > 0)
    ceiling = batch_size * (gamma + 1) + limits.max_batch_size
    if not floor <= outcome.generated_tokens <= ceiling:
        raise InvalidArgumentError(
            f"generated_tokens ({outcome.generated_tokens}) must be in {floor}..{ceiling}: "
            "each request that verified drafts samples a token at least, and a step of "
            f"{batch_size} requests at gamma {gamma} samples at most {gamma + 1} each (plus "
            f"one per request joining, at most {limits.max_batch_size})"
        )


def _check_engine_id(engine_id: str, limits: Limits) -> None:
    if not engine_id:
        raise InvalidArgumentError("engine_id is required")
    if len(engine_id) > limits.max_engine_id_length:
        raise InvalidArgumentError(
            f"engine_id is longer than {limits.max_engine_id_length} characters"
        )


# Linux's PATH_MAX and NAME_MAX: longer client-given paths fail in the OS, not here.
MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255


def check_client_path(given: str) -> None:
    """A file path from a client (Restore, a params field naming a file) must be one the
    OS can look up: no NUL byte, within PATH_MAX and NAME_MAX (INVALID_ARGUMENT)."""
    encoded = given.encode("utf-8", "surrogateescape")
    if b"\0" in encoded:
        raise InvalidArgumentError("a file path must not contain a NUL byte")
    if len(encoded) > MAX_PATH_BYTES or any(
        len(part) > MAX_NAME_BYTES for part in encoded.split(b"/")
    ):
        raise InvalidArgumentError(
            f"file path too long (at most {MAX_PATH_BYTES} bytes, {MAX_NAME_BYTES} per name)"
        )
