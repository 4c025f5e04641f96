"""γ is clamped centrally to 0..min(the engine's max_gamma, the policy's Γmax) after every
policy decision (every entry of every table); a clamp is a policy defect: counted and logged
once per policy version."""

from __future__ import annotations

import logging

import pytest

from nightjar_common.types import BinType, Choice, StepContext
from policy_server.service import DecisionService


def defects(service: DecisionService, policy: str) -> float:
    value = service.metrics.registry.get_sample_value(
        "nightjar_policy_defects_total", {"policy": policy, "kind": "gamma_clamped"}
    )
    return value or 0.0


def test_static_gamma_8_answers_at_most_the_engines_max_gamma() -> None:
    service = DecisionService("static", {"gamma": 8})
    ctx = StepContext(engine_id="e0", batch_size=4, max_gamma=2)
    assert service.run_step(ctx).gamma == 2
    table = service.table_step([], [], ctx).table
    assert table is not None and set(table.gammas) == {2}
    assert defects(service, "static") == 0, "static keeps to the engine's limit itself"


def test_every_decision_path_clamps_a_defective_policy(caplog: pytest.LogCaptureFixture) -> None:
    service = DecisionService("static", {"gamma": 8})
    policy = service.active.policy
    policy.decide = lambda ctx: Choice(gamma=8, bin_type=BinType.FIXED)  # type: ignore[method-assign]
    ctx = StepContext(engine_id="e0", batch_size=4, max_gamma=2)
    with caplog.at_level(logging.WARNING, logger="policy_server.decisions"):
        ran = service.run_step(ctx)
        table = service.table_step([], [], ctx).table
    assert ran.gamma == 2 and set(ran.table.gammas) == {2}
    assert table is not None and set(table.gammas) == {2}
    assert defects(service, "static") == len(ran.table.gammas) + len(table.gammas)
    warnings = [r for r in caplog.records if "a policy defect" in r.getMessage()]
    assert len(warnings) == 1, "logged once per policy version"
    assert "gamma 8 outside 0..2" in warnings[0].getMessage()


def test_within_bounds_is_not_a_defect() -> None:
    service = DecisionService("static", {"gamma": 8})
    assert service.run_step(StepContext(engine_id="e0", batch_size=4)).gamma == 8  # 0: no limit
    assert service.run_step(StepContext(engine_id="e0", batch_size=4, max_gamma=9)).gamma == 8
    assert defects(service, "static") == 0


def test_a_negative_or_oversized_choice_never_reaches_the_engine(
    caplog: pytest.LogCaptureFixture,
) -> None:
    service = DecisionService("static", {"gamma": 4})
    policy = service.active.policy
    answer = [-5]
    policy.decide = lambda ctx: Choice(  # type: ignore[method-assign]
        gamma=answer[0], bin_type=BinType.FIXED, request_gammas=(("r1", 70),)
    )
    with caplog.at_level(logging.WARNING, logger="policy_server.decisions"):
        low = service.run_step(StepContext(engine_id="e0", batch_size=4))
        answer[0] = 64
        high = service.run_step(StepContext(engine_id="e0", batch_size=4))
    assert (low.gamma, low.request_gammas) == (0, (("r1", 0),))
    assert (high.gamma, high.request_gammas) == (4, (("r1", 4),))
    assert defects(service, "static") == len(low.table.gammas) + len(high.table.gammas)
    # A new policy version logs its own defect again.
    service.swap("static", {"gamma": 8}, keep_state=False)
    service.active.policy.decide = lambda ctx: Choice(gamma=9, bin_type=BinType.FIXED)  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="policy_server.decisions"):
        assert service.run_step(StepContext(engine_id="e0", batch_size=4)).gamma == 8
    assert len([r for r in caplog.records if "a policy defect" in r.getMessage()]) == 2
