"""The SGLang-style EMA policy: tiers, warm-up, hysteresis moves and the γ=0 probe."""

from __future__ import annotations

import pytest

from nightjar_common.types import StepContext, StepOutcome
from policy_server.policies import PolicyError, create_policy
from policy_server.policies.ema import EmaPolicy


def feed(policy: EmaPolicy, batch_size: int, accepted_per_request: float, steps: int) -> list[int]:
    gammas = []
    for _ in range(steps):
        ctx = StepContext("e", batch_size=batch_size)
        choice = policy.decide(ctx)
        accepted = int(accepted_per_request * batch_size) if choice.gamma else 0
        policy.observe(
            ctx,
            choice,
            StepOutcome(
                "d", "e", choice.gamma, 0.01, batch_size, batch_size * choice.gamma, accepted
            ),
        )
        gammas.append(choice.gamma)
    return gammas


def test_tiers_start_in_the_middle_candidate_and_clip_to_gamma_max() -> None:
    policy = EmaPolicy({"gamma_max": 4})
    assert [policy.decide(StepContext("e", batch_size=b)).gamma for b in (1, 8, 32, 64, 500)] == [
        3,
        1,
        1,
        0,
        0,
    ]


def test_high_acceptance_moves_up_low_moves_down() -> None:
    up = feed(EmaPolicy({"gamma_max": 7}), 1, accepted_per_request=6.0, steps=60)
    assert up[:10] == [3] * 10 and up[-1] == 7
    down = feed(EmaPolicy({"gamma_max": 7}), 1, accepted_per_request=0.0, steps=60)
    assert down[-1] == 1


def test_a_zero_step_slot_probes_the_smallest_positive_step() -> None:
    policy = EmaPolicy()
    gammas = feed(policy, 8, accepted_per_request=0.0, steps=80)
    assert 0 in gammas and gammas.count(1) > 0  # it keeps probing rather than dead-locking


def test_state_round_trip_and_bad_params() -> None:
    policy = EmaPolicy()
    feed(policy, 8, 1.0, 30)
    clone = create_policy("ema")
    clone.load_state(policy.state())
    assert clone.state() == policy.state()
    with pytest.raises(PolicyError):
        EmaPolicy({"tiers": [[1]]})
