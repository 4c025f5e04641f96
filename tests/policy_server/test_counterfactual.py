"""Offline evaluation on a decision log (`nightjarctl evaluate`): a log written by the real
service under `nightjar` (which tries every γ at every batch size) on a synthetic engine
whose best γ per batch size is known exactly."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from policy_server.counterfactual import EvaluationError, LoggedStep, evaluate, read_log
from policy_server.decision_log import DecisionLog
from policy_server.service import DecisionService
from tests.policy_server.policies.test_goodput_policy import GAMMA_MAX, Environment, context

BATCHES = (4, 64, 128)  # best γ 4, 1 and 0 in the environment


def write_log(path: Path, policy: str, params: dict[str, object], steps: int) -> Environment:
    env = Environment(alpha=0.7)
    log = DecisionLog(path)
    service = DecisionService(policy, params, decision_log=log)
    for i in range(steps):
        ctx = context(BATCHES[i % len(BATCHES)], i)
        decision = service.run_step(ctx)
        service.report(env.outcome(ctx, decision.gamma, decision.decision_id))
    log.close()
    return env


@pytest.fixture(scope="module")
def explored_log(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Environment]:
    path = tmp_path_factory.mktemp("log") / "decisions.jsonl"
    return path, write_log(path, "nightjar", {"seed": 1, "gamma_max": GAMMA_MAX}, 3000)


def test_values_a_fixed_gamma_as_the_engine_measured_it(
    explored_log: tuple[Path, Environment],
) -> None:
    """γ = 0 at batch 64 is worth goodput(64, 0) / goodput(64, 1) of the best, as the
    environment defines it (within the timing noise); the best γ is worth 1."""
    path, env = explored_log
    steps = read_log([path])
    off = evaluate(steps, "off", seeds=1, min_batch=64)
    static_1 = evaluate(steps, "static", {"gamma": 1}, seeds=1, min_batch=33)
    at_64 = env.goodput(64, 0) / env.goodput(64, env.best_gamma(64))
    at_128 = 1.0  # γ = 0 is the best at 128
    assert off.gamma_top == GAMMA_MAX and off.decisions == 2000
    assert off.mean == pytest.approx((at_64 + at_128) / 2, abs=0.02)
    assert static_1.mean < 1.0 and off.mean < 1.0


def test_a_learning_policy_beats_the_logged_exploration(
    explored_log: tuple[Path, Environment],
) -> None:
    """`goodput`, fresh, learns on the drawn outcomes: its decode decisions reach ≥ 95 %
    of the best γ's goodput, where the logged `nightjar` choices (uniform exploration of
    whole bins) reach less, and a fixed γ = 3 less still at these batch sizes."""
    path, _ = explored_log
    steps = read_log([path])
    learned = evaluate(steps, "goodput", seeds=3)
    fixed = evaluate(steps, "static", {"gamma": 3}, seeds=1)
    assert learned.logged_policies == ["nightjar"]
    assert learned.mean >= 0.95 and learned.mean > learned.logged_value > fixed.mean


def test_a_gamma_is_priced_only_from_steps_near_the_batch_size() -> None:
    """γ = 2 logged at batch 4, 54 and 60 only: at batch 64 it is priced from the steps at
    54 and 60 (within the ratio; a line through them) and valued as the environment
    defines it; at batch 128 it is unpriced, counted as such, and not valued with the far
    smaller batches' steps (which would put it far above the best γ there)."""
    env = Environment(alpha=0.7)
    logged = [(4, g) for g in (0, 1, 2)] + [(b, g) for b in (64, 128) for g in (0, 1)]
    logged += [(54, 2), (60, 2)]
    steps = [
        LoggedStep(context(batch, i), env.outcome(context(batch, i), gamma), "static", "r1")
        for i in range(40)
        for batch, gamma in logged
    ]
    at_64 = evaluate(steps, "static", {"gamma": 2}, seeds=1, min_batch=64)
    assert at_64.decisions == 160 and at_64.unpriced == [80]  # batch 128 unpriced
    truth_64 = env.goodput(64, 2) / max(env.goodput(64, g) for g in range(3))
    assert at_64.mean == pytest.approx(truth_64, abs=0.02)
    assert truth_64 < 0.97  # so the pricing at 64 is what is being checked
    one = evaluate(steps, "static", {"gamma": 1}, seeds=1, min_batch=128)
    assert one.unpriced == [0] and one.logged_unpriced == 0
    assert one.mean == pytest.approx(
        env.goodput(128, 1) / max(env.goodput(128, g) for g in range(2)), abs=0.02
    )


def test_a_log_without_every_gamma_is_refused_clearly(tmp_path: Path) -> None:
    path = tmp_path / "decisions.jsonl"
    write_log(path, "static", {"gamma": 1}, 30)
    with pytest.raises(EvaluationError, match="decode steps at γ = 0 and γ = 1"):
        evaluate(read_log([path]), "goodput", seeds=1)


def test_a_log_without_accepts_says_what_it_lacks(
    explored_log: tuple[Path, Environment],
) -> None:
    """Decode steps at every γ, but none of γ 1 with per-request accepts: the error says
    that, not that γ 1 is missing."""
    path, _ = explored_log
    steps = [
        dataclasses.replace(s, outcome=dataclasses.replace(s.outcome, request_accepts=()))
        if s.outcome.gamma == 1
        else s
        for s in read_log([path])
    ]
    with pytest.raises(EvaluationError) as refused:
        evaluate(steps, "goodput", seeds=1)
    assert str(refused.value).endswith(
        f"it has decode steps at γ {list(range(GAMMA_MAX + 1))}, but those at γ 1 carry no "
        "per-request accepts"
    )
    with pytest.raises(EvaluationError, match=r"none at γ 0 or 1$"):
        evaluate([s for s in steps if s.outcome.gamma > 1], "goodput", seeds=1)


def test_nightjarctl_evaluate(explored_log: tuple[Path, Environment], tmp_path: Path) -> None:
    path, _ = explored_log
    run = [sys.executable, "-m", "policy_server.ctl", "evaluate", str(path), "--seeds", "1"]
    done = subprocess.run(
        [*run, "--policy", "static", "--params", '{"gamma": 1}', "--min-batch", "64"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "2000 decode decisions at batch >= 64, γ 0..4" in done.stdout
    assert "logged (nightjar)" in done.stdout
    bad = subprocess.run(
        [*run, "--version", "r99-none"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "no decisions with outcomes" in bad.stderr
