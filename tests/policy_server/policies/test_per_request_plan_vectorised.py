"""``best_plan`` (all caps' rows built at once) against what a plan must be: the best of
every cap and every γ_i ≤ cap (``goodput_of``, written out plainly), the largest gains
the cap allows, and the tie rules (the smaller cap, then the fewer verified drafts); and
the rows it prices, by cap, then by verified drafts S = 0..B·cap.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from policy_server.policies.models import FloatArray, verify_features
from policy_server.policies.per_request import (
    IntArray,
    Plan,
    PlanPricer,
    PlanRows,
    best_plan,
    plan_features,
    plan_rows,
)


def linear_price(rows: PlanRows, attention: FloatArray) -> FloatArray:
    ms: FloatArray = 1.0 + 0.2 * rows.caps + 0.15 * rows.verified + 0.4 * attention
    return ms


def cap_free_price(rows: PlanRows, attention: FloatArray) -> FloatArray:
    """Blind to the cap, so the caps above a plan's largest γ_i tie with it exactly."""
    ms: FloatArray = 2.0 + 0.3 * rows.verified + 0.0 * rows.caps + 0.0 * attention
    return ms


def constant_price(rows: PlanRows, attention: FloatArray) -> FloatArray:
    """Every plan costs the same: a draft that gains nothing ties with not verifying it."""
    return np.full(len(rows.caps), 3.0)


PRICES: list[PlanPricer] = [linear_price, cap_free_price, constant_price]


def goodput_of(plan: Plan, alphas: list[float], contexts: list[int], price: PlanPricer) -> float:
    """A plan's tokens per ms: B + Σ_i Σ_{k ≤ γ_i} α_i^k over the price of its cap, its
    verified drafts and its context-weighted γ̄ (γ̄ = S / B when no request has context)."""
    pairs = list(zip(alphas, plan.gammas, strict=True))
    tokens = len(alphas) + sum(a**k for a, g in pairs for k in range(1, g + 1))
    verified = sum(plan.gammas)
    total = sum(contexts)
    weighted = sum(c * g for c, g in zip(contexts, plan.gammas, strict=True))
    attention = weighted / total if total > 0 else verified / max(len(alphas), 1)
    row = PlanRows(len(alphas), plan.cap, np.array([plan.cap]), np.array([float(verified)]))
    ms = price(row, np.array([attention]))
    return tokens / float(ms[0])


def random_case(rng: random.Random) -> tuple[list[float], list[int], int]:
    batch, top = rng.randint(0, 3), rng.randint(0, 3)
    # Repeated α (equal gains across requests), α = 0 (gains of 0) and all-zero contexts.
    pool = [0.0, 0.5, 0.9, round(rng.uniform(0.0, 0.995), 3)]
    alphas = [rng.choice(pool) for _ in range(batch)]
    contexts = [0] * batch if rng.random() < 0.25 else [rng.randint(0, 500) for _ in alphas]
    return alphas, contexts, top


@pytest.mark.parametrize("price", PRICES, ids=lambda p: p.__name__)
def test_the_plan_is_the_best_assignment_and_takes_the_largest_gains(price: PlanPricer) -> None:
    rng = random.Random(7)
    for _ in range(150):
        alphas, contexts, top = random_case(rng)
        plan = best_plan(alphas, contexts, top, price)
        batch = len(alphas)
        assert len(plan.gammas) == batch
        assert 0 <= plan.cap <= (top if batch else 0)
        assert all(0 <= g <= plan.cap for g in plan.gammas)
        best = max(
            goodput_of(Plan(cap, gammas, 0.0, 0.0), alphas, contexts, price)
            for cap in range((top if batch else 0) + 1)
            for gammas in itertools.product(range(cap + 1), repeat=batch)
        )
        assert plan.goodput == pytest.approx(best, rel=1e-12)
        assert goodput_of(plan, alphas, contexts, price) == pytest.approx(plan.goodput)
        # Each request's drafts 1..γ_i, and no draft left under the cap gains more than one
        # taken: the plan's S drafts are the S largest gains the cap allows.
        pairs = list(zip(alphas, plan.gammas, strict=True))
        taken = [a**k for a, g in pairs for k in range(1, g + 1)]
        left = [a**k for a, g in pairs for k in range(g + 1, plan.cap + 1)]
        if taken and left:
            assert min(taken) >= max(left)


@pytest.mark.parametrize("price", [linear_price, cap_free_price], ids=lambda p: p.__name__)
def test_ties_go_to_the_smallest_cap_that_holds_the_plan(price: PlanPricer) -> None:
    """With a price that does not fall with the cap, a cap above the largest γ_i is never
    better than the largest γ_i as the cap, at best equal."""
    rng = random.Random(11)
    for _ in range(300):
        alphas, contexts, top = random_case(rng)
        plan = best_plan(alphas, contexts, top, price)
        assert plan.cap == max(plan.gammas, default=0)


def test_ties_go_to_the_fewer_verified_drafts() -> None:
    """Under one price for every plan, a draft of α = 0 adds nothing and is not verified,
    while any other draft adds tokens at no cost and is."""
    alphas, contexts = [0.0, 0.7, 0.0, 0.4], [100, 0, 300, 50]
    for top in range(5):
        plan = best_plan(alphas, contexts, top, constant_price)
        assert plan == Plan(top, (0, top, 0, top), plan.goodput, plan.batch_goodput)
    assert best_plan([0.0, 0.0], [1, 2], 4, constant_price).cap == 0


@pytest.mark.parametrize("contexts", [[40, 0, 160], [0, 0, 0]])
def test_the_rows_priced_are_by_cap_then_by_verified_drafts(contexts: list[int]) -> None:
    alphas, top = [0.8, 0.3, 0.6], 4
    batch = len(alphas)
    seen: list[tuple[IntArray, FloatArray, FloatArray]] = []

    def price(rows: PlanRows, attention: FloatArray) -> FloatArray:
        seen.append((rows.caps.copy(), rows.verified.copy(), attention.copy()))
        return linear_price(rows, attention)

    best_plan(alphas, contexts, top, price)
    [(caps, verified, attention)] = seen
    assert caps.dtype == np.intp and verified.dtype == attention.dtype == np.float64
    sizes = [1 + batch * cap for cap in range(top + 1)]
    assert caps.tolist() == [cap for cap, size in enumerate(sizes) for _ in range(size)]
    assert verified.tolist() == [float(s) for size in sizes for s in range(size)]
    # Every cap's last row verifies every draft: Σ context_i·cap / Σ context_i, or its
    # verified drafts per request without contexts.
    ends = np.cumsum(sizes) - 1
    assert attention[ends] == pytest.approx(np.arange(top + 1))
    assert np.all(attention[np.cumsum(sizes) - np.array(sizes)] == 0.0)


@pytest.mark.parametrize(("batch", "top", "min_passes"), [(1, 1, 0), (7, 4, 0), (32, 4, 2)])
def test_plan_features_are_verify_features_bit_for_bit(
    batch: int, top: int, min_passes: int
) -> None:
    """The rows' shape columns are cached and shared: each search's attention and context
    fill a copy, never the cache."""
    rows = plan_rows(batch, top)
    assert plan_rows(batch, top) is rows and not rows.caps.flags.writeable
    rng = np.random.default_rng(batch)
    for context in (0, 400 * batch, 9000 * batch):
        attention = rng.uniform(0.0, top, rows.caps.size)
        passes = np.maximum(rows.caps, min_passes).astype(np.float64)
        expected = verify_features(batch, passes, rows.verified, attention, context)
        got = plan_features(rows, min_passes, attention, context)
        assert got.tobytes() == expected.tobytes()
