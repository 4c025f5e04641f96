"""The goodput policy's "auto" per-request mode (the default): an engine plans per request
only while its requests' learned acceptance is surely far enough apart for a plan to beat
the batch γ, goes back with hysteresis, never plans for an engine that cannot apply
per-request γ, and says which mode it is in and why (state, metric). The environment is
test_goodput_per_request's synthetic one (docs/POLICIES.md, "Per-request mode")."""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import pytest
from prometheus_client import generate_latest

from nightjar_common.types import Choice, EngineRuntime
from policy_server.metrics import Metrics
from policy_server.policies import PolicyError
from policy_server.policies.goodput import GoodputModelPolicy
from policy_server.policies.per_request import RequestRecord
from policy_server.policies.request_mode import (
    GainAverage,
    ModeParams,
    Reason,
    RequestMode,
    sure_alphas,
)
from tests.policy_server.policies.test_goodput_per_request import (
    GAMMA_MAX,
    batch_of,
    outcome,
    request_context,
)

# Requests that all accept alike.
ALIKE = {f"r{i}": 0.6 for i in range(16)}
# Requests far apart: the pooled batch γ's fit alone then prices a plan well ahead. (With
# 0.9 against 0.3 the batch steps alone do not split a step's cost between verified tokens
# and draft passes well enough to see the plans' gain: docs/POLICIES.md.)
FAR = {**{f"hi{i}": 0.95 for i in range(8)}, **{f"lo{i}": 0.05 for i in range(8)}}
PARAMS = ModeParams(gain_on=0.02, gain_off=0.01, window_checks=16, min_checks=4, sure_z=1.0)


def auto(**params: Any) -> GoodputModelPolicy:
    return GoodputModelPolicy({"gamma_max": GAMMA_MAX, "seed": 3, **params})


def drive(
    policy: GoodputModelPolicy,
    alphas: dict[str, float],
    steps: int,
    runtime: EngineRuntime | None = None,
    start: int = 0,
) -> list[Choice]:
    rng = random.Random(7)
    ids = list(alphas)
    chosen = []
    for i in range(start, start + steps):
        ctx = dataclasses.replace(request_context(batch_of(ids, i), i), runtime=runtime)
        choice = policy.decide(ctx)
        policy.observe(ctx, choice, outcome(ctx, choice, alphas, rng))
        chosen.append(choice)
    return chosen


def mode_of(policy: GoodputModelPolicy) -> dict[str, Any]:
    view: dict[str, Any] = policy.state()["engines"]["e"]["request_mode"]
    return view


def test_the_default_is_auto_and_its_parameters_are_checked() -> None:
    assert GoodputModelPolicy().params()["per_request"] == "auto"
    for bad in (
        {"per_request": "on"},
        {"request_gain_on": 0.01, "request_gain_off": 0.02},
        {"request_sure_z": -1.0},
        {"request_check_steps": 0},
        {"request_gain_window": 0},
    ):
        with pytest.raises(PolicyError):
            auto(**bad)
    # A TPOT SLO combines with "auto" (which then never plans), not with a forced mode.
    auto(tpot_slo_ms=30.0)


def test_a_mode_engages_once_sure_and_releases_only_below_the_lower_margin() -> None:
    mode = RequestMode()
    for _ in range(3):
        mode.check(0.5, PARAMS)
    assert not mode.engaged and mode.reason is Reason.LEARNING  # too few checks
    for _ in range(8):
        mode.check(0.05, PARAMS)
    assert mode.engaged and mode.reason is Reason.GAIN_ABOVE_MARGIN and mode.switches == 1
    # Between the margins: it stays where it is (no flapping).
    for _ in range(200):
        mode.check(0.015, PARAMS)
    assert mode.engaged and mode.switches == 1
    for _ in range(200):
        mode.check(0.0, PARAMS)
    assert not mode.engaged and mode.reason is Reason.GAIN_BELOW_MARGIN and mode.switches == 2
    for _ in range(200):
        mode.check(0.015, PARAMS)
    assert not mode.engaged and mode.switches == 2


def test_noisy_gains_around_the_margin_are_not_sure_enough_to_engage() -> None:
    """A mean just above the margin with a spread wider than the distance: the lower
    bound stays below it."""
    mode = RequestMode()
    rng = random.Random(1)
    for _ in range(12):
        mode.check(0.021 + rng.choice((-0.2, 0.2)), PARAMS)
    assert not mode.engaged


def test_the_gain_average_forgets_and_bounds_its_mean() -> None:
    average = GainAverage()
    assert average.bounds(1.0) == (float("-inf"), float("inf"))
    for gain in (0.1, 0.3) * 50:
        average.add(gain, 0.9)
    low, high = average.bounds(1.0)
    assert low < average.mean < high and abs(average.mean - 0.2) < 0.02
    assert average.weight == pytest.approx(10.0, rel=0.01)  # 1 / (1 - 0.9) checks remembered


def test_sure_alphas_keep_requests_apart_only_as_far_as_their_counts_make_sure() -> None:
    young = RequestRecord(successes=3.0, failures=0.0, last_seen=0)
    old = RequestRecord(successes=900.0, failures=100.0, last_seen=0)
    low = RequestRecord(successes=50.0, failures=150.0, last_seen=0)
    alphas = sure_alphas([None, young, old, low], 0.6, 12.0, 1.0)
    assert alphas[0] == 0.6
    assert alphas[1] == 0.6  # its distance is within one standard error
    assert 0.88 < alphas[2] < 0.9 and 0.3 < alphas[3] < 0.4
    assert sure_alphas([old], 0.6, 12.0, 0.0)[0] == pytest.approx((900 + 12 * 0.6) / 1012)


def test_requests_far_apart_engage_per_request_plans_by_themselves() -> None:
    policy = auto()
    chosen = drive(policy, FAR, 600)
    view = mode_of(policy)
    assert view["mode"] == "per-request" and view["reason"] == "gain_above_margin"
    assert view["gain_bounds"][0] > policy.params()["request_gain_on"]
    assert view["switches"] == 1  # engaged once, never flapped
    planned = [c for c in chosen[-100:] if c.request_gammas]
    assert len(planned) >= 50
    assert policy.request_modes() == {"e": ("per-request", "gain_above_margin")}


def test_requests_alike_stay_on_the_batch_gamma() -> None:
    policy = auto()
    chosen = drive(policy, ALIKE, 600)
    view = mode_of(policy)
    assert view["mode"] == "batch" and view["reason"] == "gain_below_margin"
    assert view["switches"] == 0 and view["checks"] > 30
    assert not any(c.request_gammas for c in chosen)


def test_an_engine_that_cannot_apply_per_request_gamma_never_gets_a_plan() -> None:
    policy = auto()
    chosen = drive(policy, FAR, 600, runtime=EngineRuntime(async_scheduling=True))
    assert not any(c.request_gammas for c in chosen)
    view = mode_of(policy)
    assert view["mode"] == "batch" and view["reason"] == "engine_cannot_apply"
    # The same engine scheduling synchronously plans.
    synchronous = auto()
    drive(synchronous, FAR, 600, runtime=EngineRuntime(async_scheduling=False))
    assert mode_of(synchronous)["mode"] == "per-request"


def test_an_engaged_engine_that_turns_out_unable_stops_planning_at_once() -> None:
    policy = auto()
    drive(policy, FAR, 600)
    assert mode_of(policy)["mode"] == "per-request"
    runtime = EngineRuntime(async_scheduling=True)
    ctx = dataclasses.replace(request_context(batch_of(list(FAR), 600), 600), runtime=runtime)
    assert not policy.decide(ctx).request_gammas


@pytest.mark.parametrize(("forced", "mode"), [(True, "per-request"), (False, "batch")])
def test_a_forced_mode_is_kept_and_said(forced: bool, mode: str) -> None:
    policy = auto(per_request=forced)
    chosen = drive(policy, ALIKE if forced else FAR, 200)
    view = mode_of(policy)
    assert view == {"mode": mode, "reason": "forced_on" if forced else "forced_off"}
    if not forced:
        assert not any(c.request_gammas for c in chosen)


def test_a_tpot_slo_keeps_auto_on_the_batch_gamma() -> None:
    policy = auto(tpot_slo_ms=1000.0)
    chosen = drive(policy, FAR, 400)
    assert mode_of(policy)["reason"] == "tpot_slo"
    assert not any(c.request_gammas for c in chosen)


def test_the_mode_survives_a_state_round_trip_and_decisions_continue_alike() -> None:
    trained = auto()
    drive(trained, FAR, 600)
    restored = auto()
    restored.load_state(json.loads(json.dumps(trained.state())))
    assert mode_of(restored) == mode_of(trained)
    assert drive(restored, FAR, 50, start=600) == drive(trained, FAR, 50, start=600)


def test_a_state_without_a_mode_loads_on_the_batch_gamma() -> None:
    trained = auto()
    drive(trained, FAR, 600)
    state = json.loads(json.dumps(trained.state()))
    del state["engines"]["e"]["request_mode"]
    restored = auto()
    restored.load_state(state)
    assert mode_of(restored)["mode"] == "batch" and mode_of(restored)["checks"] == 0


def test_the_metric_says_each_engines_mode_and_why() -> None:
    policy = auto()
    drive(policy, FAR, 600)
    metrics = Metrics()
    assert b"nightjar_request_mode{" not in generate_latest(metrics.registry)
    metrics.request_modes.watch(lambda: policy)
    text = generate_latest(metrics.registry).decode()
    line = 'nightjar_request_mode{engine="e",mode="per-request",reason="gain_above_margin"} 1.0'
    assert line in text
    metrics.request_modes.watch(lambda: object())  # a policy without modes: no series
    assert "nightjar_request_mode{" not in generate_latest(metrics.registry).decode()


def test_an_unlabelled_outcome_teaches_no_request_record() -> None:
    """Accepts without request ids (an engine that names no requests) are the pooled
    model's alone."""
    policy = auto()
    rng = random.Random(3)
    ctx = request_context(["a", "b"], 0)
    choice = policy.decide(ctx)
    unlabelled = dataclasses.replace(outcome(ctx, choice, {"a": 0.9, "b": 0.9}, rng))
    unlabelled = dataclasses.replace(unlabelled, request_ids=())
    policy.observe(ctx, choice, unlabelled)
    assert policy.state()["engines"]["e"]["requests"] == {}


def test_the_modes_read_while_a_decision_adds_an_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The metric reads on the scrape's thread: an engine added meanwhile does not break
    the read (it iterates over a copy)."""
    policy = auto()
    drive(policy, FAR, 40)
    shown = policy._mode_json

    def adding(engine: Any) -> dict[str, Any]:
        policy.decide(dataclasses.replace(request_context(["x"], 0), engine_id="new"))
        return shown(engine)

    monkeypatch.setattr(policy, "_mode_json", adding)
    assert policy.request_modes() == {"e": ("batch", "learning")}
