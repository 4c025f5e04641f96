"""The goodput policy prices the step's own batch size with its requests' own acceptance:
at batch 1 a request that accepts nearly everything gets the long γ, one that accepts
little the short one, from the request's first steps on, where the pooled α (a window over
the recent steps, so over the requests before) would give both the γ of their mix
(docs/POLICIES.md, "A batch's own requests"). The environment is test_goodput_per_request's
synthetic one: requests one after another, alone in the batch, alternately far apart."""

from __future__ import annotations

import random
import statistics

import pytest

from nightjar_common.types import StepContext
from policy_server.policies.goodput import GoodputModelPolicy
from policy_server.policies.models import batch_rows
from tests.policy_server.policies.test_goodput_per_request import (
    GAMMA_MAX,
    outcome,
    request_context,
)

# Steps each request stays in the batch, and the acceptance of each kind of request.
REQUEST_STEPS = 24
HIGH, LOW = 0.9, 0.25


def run_alone(policy: GoodputModelPolicy, requests: int) -> dict[str, list[int]]:
    """Requests one at a time, high and low in turn: per request, the γ of its steps."""
    rng = random.Random(5)
    alphas: dict[str, float] = {}
    chosen: dict[str, list[int]] = {}
    step = 0
    for n in range(requests):
        rid = f"{'hi' if n % 2 == 0 else 'lo'}{n}"
        alphas[rid] = HIGH if n % 2 == 0 else LOW
        for _ in range(REQUEST_STEPS):
            ctx = request_context([rid], step)
            choice = policy.decide(ctx)
            policy.observe(ctx, choice, outcome(ctx, choice, alphas, rng))
            chosen.setdefault(rid, []).append(choice.gamma)
            step += 1
    return chosen


def settled(chosen: dict[str, list[int]], kind: str, skip_requests: int) -> float:
    """The mean γ of ``kind`` requests after their first few steps, past the first
    ``skip_requests`` requests (the engine's warm-up)."""
    gammas = [
        g
        for n, (rid, steps) in enumerate(chosen.items())
        if n >= skip_requests and rid.startswith(kind)
        for g in steps[6:]
    ]
    return statistics.mean(gammas)


def test_a_request_alone_in_the_batch_gets_the_gamma_of_its_own_acceptance() -> None:
    chosen = run_alone(GoodputModelPolicy({"gamma_max": GAMMA_MAX, "seed": 3}), 40)
    # The truth (test_goodput_per_request.step_ms at batch 1): γ = 4 for α = 0.9, γ = 1
    # for α = 0.25; the pooled α of the two (about 0.6) would give both γ = 2.
    assert settled(chosen, "hi", 10) >= 3.5
    assert settled(chosen, "lo", 10) <= 1.5


@pytest.mark.parametrize("per_request", [True, "auto"])
def test_only_the_contexts_own_size_is_priced_with_its_requests(per_request: bool | str) -> None:
    policy = GoodputModelPolicy({"gamma_max": GAMMA_MAX, "seed": 3, "per_request": per_request})
    run_alone(policy, 12)
    ctx = request_context(["hi12"], 999)
    # A request never seen is at the pooled α: its size is priced as every other.
    engine, top = policy._engine_and_top(ctx)
    learner = policy._book.learner(engine.learner_id)
    assert policy._estimate(learner, ctx, top, engine=engine).own is None
    seen = request_context(["hi10"], 999)
    estimate = policy._estimate(learner, seen, top, engine=engine)
    assert estimate.own is not None and estimate.own[0] == 1
    tokens = estimate.row_tokens(batch_rows((1, 2)))
    assert tokens[0].tolist() == estimate.own[1]  # α = 0.9 request: more than the pool
    assert tokens[0][-1] > tokens[1][-1] and tokens[1].tolist() == estimate.tokens
    # A context that does not name its whole batch prices with the pooled α alone.
    partial = StepContext("e", 2, step_index=999, max_gamma=GAMMA_MAX, requests=seen.requests)
    assert policy._estimate(learner, partial, top, engine=engine).own is None


def test_without_request_records_the_pooled_alpha_prices_every_size() -> None:
    policy = GoodputModelPolicy({"gamma_max": GAMMA_MAX, "seed": 3, "per_request": False})
    run_alone(policy, 4)
    ctx = request_context(["hi2"], 999)
    engine, top = policy._engine_and_top(ctx)
    learner = policy._book.learner(engine.learner_id)
    assert policy._estimate(learner, ctx, top, engine=engine).own is None
