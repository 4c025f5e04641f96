"""DSDE (arXiv:2509.01083): per-sequence γ from the weighted variance of recent KL
divergence (WVIR), the batch capped at the mean of the per-sequence lengths."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nightjar_common.types import BinType, Choice, RequestSignals, StepContext, StepOutcome
from policy_server.policies import PolicyError, create_policy
from policy_server.policies.dsde import DsdePolicy, weighted_variance

CALIBRATION = 5


def policy(**params: object) -> DsdePolicy:
    made = create_policy("dsde", {"gamma_max": 6, "calibration_steps": CALIBRATION, **params})
    assert isinstance(made, DsdePolicy)
    return made


def step(
    index: int, requests: dict[str, float | None], accepted: dict[str, int], **extra: object
) -> StepContext:
    return StepContext(
        "e",
        max(1, len(requests)),
        step_index=index,
        requests=tuple(
            RequestSignals(rid, kl_divergence=kl, recent_accepts=(accepted.get(rid, 0),))
            for rid, kl in requests.items()
        ),
        **{"max_gamma": 6, **extra},  # type: ignore[arg-type]
    )


def run(made: DsdePolicy, ctx: StepContext, accepts: tuple[int, ...]) -> Choice:
    choice = made.decide(ctx)
    outcome = StepOutcome(
        decision_id=str(ctx.step_index),
        engine_id="e",
        gamma=choice.gamma,
        step_seconds=0.02,
        generated_tokens=sum(accepts) + len(accepts),
        drafted_tokens=choice.gamma * len(accepts),
        accepted_tokens=sum(accepts),
        request_accepts=accepts,
    )
    made.observe(ctx, choice, outcome)
    return choice


def test_weighted_variance_is_eqs_5_to_7() -> None:
    values = [0.3, 0.1, 0.8, 0.5, 0.2]
    weights = 0.85 ** np.arange(len(values))[::-1]  # the newest (last) weighs 1
    mean = np.average(values, weights=weights)
    expected = np.average((np.array(values) - mean) ** 2, weights=weights)
    assert weighted_variance(values, 0.85) == pytest.approx(expected)


def test_calibration_runs_at_full_length_then_sl_max_is_eq_1() -> None:
    made = policy()
    kls = [0.1, 0.3, 0.2, 0.4, 0.1]
    for i, kl in enumerate(kls):
        choice = run(made, step(i, {"a": kl}, {"a": 2}), (3 if i == 2 else 2,))
        assert (choice.gamma, choice.bin_type) == (6, BinType.EXPLORE)
    calibration = made.state("e")["engines"]["e"]["calibration"]
    assert calibration["max_accepted"] == 3
    sl_max = 3 * (1 + (sum(kls) / len(kls)) / (max(kls) + 1e-6))  # eq. 1: 4.65
    # Eq. 2 for the next step: SF from its divergence; both windows hold the same six
    # values yet, so WVIR = 1.
    scale = math.exp(2 * 0.1) - 1
    assert made.decide(step(9, {"a": 0.1}, {})).gamma == round((1 - scale) * (sl_max - 2) + 2)


def test_a_volatile_request_gets_less_than_a_stable_one_and_the_batch_is_capped() -> None:
    made = policy()
    rng = np.random.default_rng(0)
    for i in range(CALIBRATION + 40):
        stable, volatile = 0.05, float(rng.choice([0.05, 1.5]))
        ctx = step(i, {"stable": stable, "volatile": volatile}, {"stable": 5, "volatile": 1})
        run(made, ctx, (5, 1))
    choice = made.decide(step(100, {"stable": 0.05, "volatile": 1.5}, {}))
    gammas = dict(choice.request_gammas)
    assert gammas["volatile"] < gammas["stable"]
    assert gammas["volatile"] == 2  # SF · WVIR > 1 (eq. 8): SL_min
    # SL_cap: the mean of the per-sequence lengths, and no request above it.
    assert choice.gamma == round((6 + 2) / 2)
    assert max(gammas.values()) == choice.gamma


def test_without_a_measured_divergence_acceptance_is_the_proxy() -> None:
    made = policy()
    for i in range(CALIBRATION + 30):
        accepted = {"greedy": 6, "creative": int(i % 3 == 0) * 3}
        run(made, step(i, dict.fromkeys(accepted), accepted), (6, accepted["creative"]))
    choice = made.decide(step(100, {"greedy": None, "creative": None}, {"greedy": 6}))
    gammas = dict(choice.request_gammas)
    assert gammas["creative"] < gammas["greedy"]


def test_an_engine_without_per_request_signals_is_one_sequence() -> None:
    """The batch's mean proxy from the outcome's per-request accepts: an engine whose
    batch accepts its drafts gets a longer γ than one whose batch rejects them (both
    steady: WVIR 1, SF from the proxy)."""
    accepting, rejecting = policy(), policy()
    for i in range(CALIBRATION + 40):
        run(accepting, step(i, {}, {}), (6, 6, 6))
        run(rejecting, step(i, {}, {}), (6, 6, 6) if i < CALIBRATION else (0, 0, 0))
    good, bad = accepting.decide(step(99, {}, {})), rejecting.decide(step(99, {}, {}))
    assert not good.request_gammas and not bad.request_gammas
    assert bad.gamma == 2 < good.gamma


def test_bounds_the_engine_sets() -> None:
    made = policy()
    for i in range(CALIBRATION + 5):
        run(made, step(i, {"a": 0.1}, {"a": 6}), (6,))
    away = made.decide(step(50, {"a": 0.1}, {}, draft_resident=False))
    assert (away.gamma, away.bin_type) == (0, BinType.FORCED)
    capped = made.decide(step(50, {"a": 0.1}, {}, max_gamma=1))
    assert capped.gamma == 1 and dict(capped.request_gammas)["a"] <= 1


def test_state_round_trips_and_a_malformed_one_is_refused() -> None:
    made = policy()
    for i in range(CALIBRATION + 12):
        run(made, step(i, {"a": 0.1 * (i % 4), "b": 0.2}, {"a": 2, "b": 4}), (2, 4))
    copy = policy()
    copy.load_state(made.state())
    ctx = step(60, {"a": 0.3, "b": 0.2}, {})
    assert copy.decide(ctx) == made.decide(ctx)
    bad = made.state()
    bad["engines"]["e"]["requests"]["a"] = [math.inf]
    with pytest.raises(PolicyError):
        policy().load_state(bad)
    with pytest.raises(PolicyError):
        policy(sl_min=9)


def test_an_engine_whose_first_steps_accepted_nothing_still_learns_sl_max() -> None:
    """Eq. 1's statistics keep counting after the calibration phase: first steps of one
    request that rejected every draft (SL_A,max 0, SL_max 0) no longer pin every request
    at SL_min for the engine's life (the simulator's mixed runs did: docs/POLICIES.md)."""
    made = policy()
    for i in range(CALIBRATION):
        run(made, step(i, {"cold": None}, {"cold": 0}), (0,))
    for i in range(CALIBRATION, CALIBRATION + 40):
        run(made, step(i, {"warm": 0.02 + 0.02 * (i % 2)}, {"warm": 4}), (4,))
    assert made.state("e")["engines"]["e"]["calibration"]["max_accepted"] == 4
    assert made.decide(step(100, {"warm": 0.02}, {"warm": 4})).gamma > 2


def test_a_request_that_rejects_every_draft_gets_sl_min_not_sl_max() -> None:
    """Its proxy is 1.0 at every step: both windows constant, WVIR 1 (not 0, which gave
    such a request the longest length), and SF = e² − 1 > 1: SL_min."""
    made = policy()
    for i in range(CALIBRATION + 30):
        accepted = {"greedy": 5, "cold": 0}
        run(made, step(i, dict.fromkeys(accepted), accepted), (5, 0))
    choice = made.decide(step(100, {"greedy": None, "cold": None}, {"greedy": 5}))
    assert dict(choice.request_gammas)["cold"] == 2
