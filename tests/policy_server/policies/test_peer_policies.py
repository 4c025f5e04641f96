"""The benchmark's peers: SmartSpec/DSD's goodput model and BanditSpec's UCB."""

from __future__ import annotations

import json

import pytest

from nightjar_common.types import BinType, StepContext, StepOutcome
from policy_server.policies import PolicyError, create_policy
from policy_server.policies.dsd import DsdPolicy, fit_latency
from policy_server.policies.models import expected_tokens
from policy_server.policies.ucb import UcbPolicy


def test_fit_latency_recovers_a_linear_profile() -> None:
    def ms(b: int, g: int, c: int) -> float:
        return 5.0 + 0.02 * b * (g + 1) + 1e-4 * c + g * (0.8 + 0.01 * b)

    # Two context lengths per batch: with one, context and tokens would be collinear.
    grid = [
        (b, g, c * b, ms(b, g, c * b))
        for b in (1, 4, 16, 64, 256)
        for g in range(5)
        for c in (300, 1500)
    ]
    fitted = fit_latency(grid)
    assert fitted["target_ms"] == pytest.approx([5.0, 0.02, 1e-4], rel=1e-6, abs=1e-9)
    assert fitted["draft_ms"] == pytest.approx([0.8, 0.01], rel=1e-6)


def test_dsd_picks_the_argmax_of_its_goodput_model_and_biases_spec_off() -> None:
    latency = {"target_ms": [10.0, 0.05, 0.0], "draft_ms": [1.0, 0.0]}
    policy = DsdPolicy({"gamma_max": 4, "start_alpha": 0.7, **latency})

    def best(batch: int) -> int:
        def goodput(g: int) -> float:
            value = batch * expected_tokens(0.7, g) / (10 + 0.05 * batch * (g + 1) + g)
            return value * 1.1 if g == 0 else value

        return max(range(5), key=goodput)

    for batch in (1, 16, 256):
        choice = policy.decide(StepContext("e", batch))
        assert choice.gamma == best(batch) and choice.bin_type is BinType.EXPLOIT
    assert best(1) > 0 and best(256) == 0


def test_dsd_acceptance_follows_the_counters_and_resets_below_0_3() -> None:
    policy = DsdPolicy({"gamma_max": 4})
    ctx = StepContext("e", 8)
    choice = policy.decide(ctx)
    for _ in range(50):  # every request rejects its first draft token: α → 0
        policy.observe(ctx, choice, StepOutcome("d", "e", 4, 0.02, 8, 32, 0, (0,) * 8))
    alpha = policy.state()["learners"]["engine:e"]
    # Below 0.3 SmartSpec resets α to 0.65 (a prior worth one small step).
    assert alpha["successes"] / (alpha["successes"] + alpha["failures"]) == pytest.approx(0.65)


def test_ucb_pulls_every_arm_once_then_follows_the_best_mean() -> None:
    policy = UcbPolicy({"gamma_max": 3, "exploration": 0.0})
    ctx = StepContext("e", 20)  # bucket 16
    goodput = {0: 100.0, 1: 300.0, 2: 200.0, 3: 50.0}
    first = []
    for _ in range(4):
        choice = policy.decide(ctx)
        first.append(choice.gamma)
        assert choice.bin_type is BinType.EXPLORE
        policy.observe(
            ctx, choice, StepOutcome("d", "e", choice.gamma, 0.01, int(goodput[choice.gamma] / 100))
        )
    assert first == [0, 1, 2, 3]
    assert {policy.decide(ctx).gamma for _ in range(5)} == {1}
    # Another bucket has arms of its own.
    assert policy.decide(StepContext("e", 3)).gamma == 0


def test_ucb_state_round_trips_and_bad_state_is_refused() -> None:
    policy = UcbPolicy({"gamma_max": 2})
    ctx = StepContext("e", 4, learner_key="m@d")
    for _ in range(6):
        choice = policy.decide(ctx)
        policy.observe(ctx, choice, StepOutcome("d", "e", choice.gamma, 0.01, 5))
    state = json.loads(json.dumps(policy.state()))
    copy = UcbPolicy({"gamma_max": 2})
    copy.load_state(state)
    assert copy.state() == state
    state["learners"]["shared:m@d"]["4"]["counts"] = [1, 2]
    with pytest.raises(PolicyError):
        copy.load_state(state)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("dsd", {"target_ms": [1.0, 2.0]}),
        ("dsd", {"off_bias": 0.0}),
        ("dsd", {"draft_ms": [float("nan"), 0.0]}),
        ("ucb", {"exploration": -1.0}),
        ("ucb", {"gamma_max": 10**9}),
    ],
)
def test_bad_parameters_are_refused(name: str, params: dict[str, object]) -> None:
    with pytest.raises(PolicyError):
        create_policy(name, params)
