"""Nightjar's algorithm (Algorithm 1 of arXiv:2512.22420), tested on the policy object."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest

from nightjar_common.types import BinType, Choice, StepContext, StepOutcome
from policy_server.policies import PolicyError, create_policy
from policy_server.policies.nightjar import NightjarPolicy

# Hand-derived from Algorithm 1 (lines 16–22): (j, H, b, τ) *before* each of the first
# 27 steps of one batch size. Bins last ⌊√H⌋ rounds, blocks ⌊√H⌋ bins; H = 2^(j−1).
PINNED_SCHEDULE = [
    (1, 1, 1, 1),
    (2, 2, 1, 1),
    (3, 4, 1, 1),
    (3, 4, 1, 2),
    (3, 4, 2, 1),
    (3, 4, 2, 2),
    (4, 8, 1, 1),
    (4, 8, 1, 2),
    (4, 8, 2, 1),
    (4, 8, 2, 2),
    *[(5, 16, b, t) for b in range(1, 5) for t in range(1, 5)],
    (6, 32, 1, 1),
]


def ctx(batch_size: int, engine: str = "e", **kw: Any) -> StepContext:
    return StepContext(engine_id=engine, batch_size=batch_size, **kw)


def outcome(choice: Choice, goodput: float, engine: str = "e") -> StepOutcome:
    """An outcome whose goodput (tokens / 1 s step) is ``goodput``."""
    return StepOutcome("d", engine, choice.gamma, step_seconds=1.0, generated_tokens=int(goodput))


def schedule_of(policy: NightjarPolicy, engine: str, batch_size: int) -> tuple[int, ...]:
    s = policy.state(engine)["engines"][engine]["schedules"][str(batch_size)]
    return (s["block"], s["block_length"], s["bin"], s["round"])


def run_step(policy: NightjarPolicy, c: StepContext, goodput_by_gamma: list[float]) -> Choice:
    choice = policy.decide(c)
    policy.observe(c, choice, outcome(choice, goodput_by_gamma[choice.gamma], c.engine_id))
    return choice


GOODPUT = [100.0, 130.0, 150.0, 140.0, 90.0]  # γ = 2 is best


def test_schedule_is_pinned_for_the_first_steps() -> None:
    policy = NightjarPolicy({"seed": 7})
    seen = []
    for _ in PINNED_SCHEDULE:
        state = policy.state("e")["engines"].get("e")
        seen.append(schedule_of(policy, "e", 3) if state else (1, 1, 1, 1))
        choice = run_step(policy, ctx(3), GOODPUT)
        # The exploration probability reported is 1/√b of the bin the step ran in.
        assert choice.exploration_probability == pytest.approx(1 / math.sqrt(seen[-1][2]))
    assert seen == PINNED_SCHEDULE


def test_a_bin_keeps_its_type_for_all_its_rounds() -> None:
    policy = NightjarPolicy({"seed": 3})
    bins: dict[tuple[int, int], set[BinType]] = {}
    for _ in range(600):
        before = schedule_of(policy, "e", 1) if policy.state("e")["engines"] else (1, 1, 1, 1)
        choice = run_step(policy, ctx(1), GOODPUT)
        bins.setdefault(before[:1] + before[2:3], set()).add(choice.bin_type)
    assert all(len(types) == 1 for types in bins.values())
    assert {BinType.EXPLORE, BinType.EXPLOIT} <= set().union(*bins.values())


@pytest.mark.slow
def test_exploration_frequency_decays_as_one_over_sqrt_b() -> None:
    """Seeded statistical test: P(bin explores | bin index b) = 1/√b."""
    policy = NightjarPolicy({"seed": 11})
    starts: dict[int, list[bool]] = {}
    for engine_number in range(300):
        engine = f"e{engine_number}"
        for _ in range(1100):
            before = policy.state(engine)["engines"].get(engine)
            choice = run_step(policy, ctx(1, engine), GOODPUT)
            sched = before["schedules"]["1"] if before else {"bin": 1, "round": 1}
            if sched["round"] == 1:
                starts.setdefault(sched["bin"], []).append(choice.bin_type is BinType.EXPLORE)
    rates = {}
    for b in (1, 2, 4, 9, 16):
        samples = starts[b]
        p = 1 / math.sqrt(b)
        rate = sum(samples) / len(samples)
        sigma = math.sqrt(p * (1 - p) / len(samples)) or 1e-9
        assert abs(rate - p) <= 4 * sigma + 1e-9, (b, rate, p, len(samples))
        rates[b] = rate
    assert rates[1] == 1.0
    assert rates[2] > rates[4] > rates[9] > rates[16]


def test_exploitation_converges_to_the_best_arm() -> None:
    policy = NightjarPolicy({"seed": 5})
    choices = [run_step(policy, ctx(2), GOODPUT) for _ in range(3000)]
    exploited = [c.gamma for c in choices[-1000:] if c.bin_type is BinType.EXPLOIT]
    assert exploited and all(g == 2 for g in exploited)


def exploit_state(means: list[float], previous_gamma: int | None, batch_size: int = 8) -> dict:
    """A state mid-way through an exploitation bin (τ = 2, so no new bin draw)."""
    return {
        "schema": "nightjar/1",
        "gamma_max": 4,
        "engines": {
            "e": {
                "learner": "engine:e",
                "previous_gamma": previous_gamma,
                "rng": 1,
                "schedules": {
                    str(batch_size): {
                        "block": 5,
                        "block_length": 16,
                        "bin": 4,
                        "round": 2,
                        "explore": False,
                    }
                },
            }
        },
        "learners": {"engine:e": {str(batch_size): {"means": means, "counts": [5] * len(means)}}},
    }


def write_cost_table(path: Path, ms: float) -> Path:
    rows = ["lag_tokens,batch_size,c_prefill_ms"]
    rows += [f"{lag},{bs},{ms * (lag / 128)}" for lag in (128, 256) for bs in (4, 16)]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_switching_cost_changes_the_argmin_when_previous_gamma_is_zero(tmp_path: Path) -> None:
    table = write_cost_table(tmp_path / "cprefill.csv", ms=20.0)
    means = [100.0, 110.0, 112.0, 111.0, 105.0]
    policy = NightjarPolicy({"prefill_cost_table": str(table)})
    lag = 128  # c_prefill = 20 ms at L_max = 128
    # γ_prev > 0: no switching cost, plain argmin of 1/g̃ → γ = 2.
    policy.load_state(exploit_state(means, previous_gamma=1))
    assert policy.decide(ctx(8, max_draft_lag_tokens=lag)).gamma == 2
    # γ_prev = 0: costs 1/g̃ + 0.020/γ: γ=0 → 0.0100, γ=4 → 0.0145, γ=2 → 0.0189 → γ = 0.
    policy.load_state(exploit_state(means, previous_gamma=0))
    choice = policy.decide(ctx(8, max_draft_lag_tokens=lag))
    assert (choice.gamma, choice.bin_type) == (0, BinType.EXPLOIT)
    # The same holds when the engine states γ_prev in the context.
    policy.load_state(exploit_state(means, previous_gamma=3))
    assert policy.decide(ctx(8, max_draft_lag_tokens=lag, previous_gamma=0)).gamma == 0


def test_after_the_draft_comes_back_the_switching_cost_applies(tmp_path: Path) -> None:
    """Elastic memory (docs/MEMORY.md): steps forced to γ=0 while the draft is offloaded
    leave γ_prev = 0, so the first decision after a verified reload weighs c_prefill like
    any switch from γ=0."""
    table = write_cost_table(tmp_path / "cprefill.csv", ms=20.0)
    means = [100.0, 110.0, 112.0, 111.0, 105.0]
    policy = NightjarPolicy({"prefill_cost_table": str(table)})
    policy.load_state(exploit_state(means, previous_gamma=2))
    away = policy.decide(ctx(8, max_draft_lag_tokens=128, draft_resident=False))
    assert (away.gamma, away.bin_type) == (0, BinType.FORCED)
    # Back: plain argmin would be γ = 2 (as with γ_prev = 2); the 20 ms catch-up makes it 0.
    assert policy.decide(ctx(8, max_draft_lag_tokens=128)).gamma == 0


def test_switching_cost_favours_longer_gamma_to_amortise(tmp_path: Path) -> None:
    table = write_cost_table(tmp_path / "cprefill.csv", ms=2.0)
    means = [50.0, 110.0, 112.0, 111.0, 108.0]
    policy = NightjarPolicy({"prefill_cost_table": str(table)})
    policy.load_state(exploit_state(means, previous_gamma=0))
    # 1/g̃ + 0.002/γ: γ=2 → 0.00993, γ=3 → 0.00968, γ=4 → 0.00976 → γ = 3 (not 2).
    assert policy.decide(ctx(8, max_draft_lag_tokens=128)).gamma == 3


def test_without_a_table_the_switching_cost_is_zero(caplog: pytest.LogCaptureFixture) -> None:
    # Whatever an earlier test left on the root logger, this logger says so, at INFO: the
    # documented default, not a mistake to warn about at every start.
    caplog.set_level(logging.INFO, logger="policy_server.policies.base")
    policy = NightjarPolicy()
    (said,) = [r for r in caplog.records if "c_prefill = 0" in r.getMessage()]
    assert said.levelno == logging.INFO
    policy.load_state(exploit_state([100.0, 110.0, 112.0, 111.0, 105.0], previous_gamma=0))
    assert policy.decide(ctx(8, max_draft_lag_tokens=4096)).gamma == 2


def test_unpulled_arms_are_never_exploited() -> None:
    policy = NightjarPolicy()
    state = exploit_state([0.0, 0.0, 80.0, 0.0, 0.0], previous_gamma=2)
    state["learners"]["engine:e"]["8"]["counts"] = [0, 0, 3, 0, 0]
    policy.load_state(state)
    assert policy.decide(ctx(8)).gamma == 2


def test_batch_sizes_are_independent_contexts() -> None:
    alone = NightjarPolicy({"seed": 1})
    for _ in range(40):
        run_step(alone, ctx(8), GOODPUT)
    mixed = NightjarPolicy({"seed": 1})
    for _ in range(40):
        run_step(mixed, ctx(8), GOODPUT)
        run_step(mixed, ctx(1), GOODPUT)
        run_step(mixed, ctx(1), GOODPUT)
    assert schedule_of(mixed, "e", 8) == schedule_of(alone, "e", 8)
    learners = mixed.state()["learners"]["engine:e"]
    assert sum(learners["8"]["counts"]) == 40
    assert sum(learners["1"]["counts"]) == 80


def test_batch_sizes_above_max_are_clamped_and_pow2_buckets() -> None:
    exact = NightjarPolicy({"max_batch_size": 16})
    assert [exact.context_key(b) for b in (1, 5, 16, 17, 1000)] == [1, 5, 16, 16, 16]
    pow2 = NightjarPolicy({"batch_bucketing": "pow2"})
    assert [pow2.context_key(b) for b in (1, 2, 3, 4, 7, 8, 100)] == [1, 2, 2, 4, 4, 8, 64]


def test_only_gamma_zero_while_the_draft_is_not_resident() -> None:
    policy = NightjarPolicy({"seed": 2})
    choices = [policy.decide(ctx(1, draft_resident=False)) for _ in range(50)]
    assert {(c.gamma, c.bin_type) for c in choices} == {(0, BinType.FORCED)}
    # Forced steps are not bandit rounds: the schedule has not moved.
    assert policy.state()["engines"]["e"]["schedules"] == {}


def test_engine_gamma_limit_is_respected() -> None:
    policy = NightjarPolicy({"seed": 4, "gamma_max": 6})
    gammas = {run_step(policy, ctx(1, max_gamma=2), [*GOODPUT, 0, 0]).gamma for _ in range(300)}
    assert gammas <= {0, 1, 2} and len(gammas) > 1


def test_decisions_are_reproducible_from_the_seed() -> None:
    def trace(seed: int) -> list[int]:
        policy = NightjarPolicy({"seed": seed})
        return [run_step(policy, ctx(1 + i % 5), GOODPUT).gamma for i in range(300)]

    assert trace(42) == trace(42)
    assert trace(42) != trace(43)


def test_engines_have_their_own_schedule_and_previous_gamma() -> None:
    policy = NightjarPolicy({"seed": 9})
    for _ in range(10):
        run_step(policy, ctx(4, "a"), GOODPUT)
    run_step(policy, ctx(4, "b"), GOODPUT)
    engines = policy.state()["engines"]
    assert engines["a"]["schedules"]["4"] != engines["b"]["schedules"]["4"]
    assert set(policy.state()["learners"]) == {"engine:a", "engine:b"}


def test_shared_learner_across_engines_of_one_model() -> None:
    policy = NightjarPolicy({"share_learner": True})
    for engine in ("a", "b"):
        for _ in range(5):
            run_step(policy, ctx(4, engine, learner_key="llama-8b/h100"), GOODPUT)
    run_step(policy, ctx(4, "c"), GOODPUT)  # no key: learns alone
    learners = policy.state()["learners"]
    assert sum(learners["shared:llama-8b/h100"]["4"]["counts"]) == 10
    assert sum(learners["engine:c"]["4"]["counts"]) == 1
    policy.reset("a")  # the shared learner survives one engine's reset
    assert "shared:llama-8b/h100" in policy.state()["learners"]


def test_state_round_trip_continues_identically() -> None:
    original = NightjarPolicy({"seed": 8})
    for i in range(200):
        run_step(original, ctx(1 + i % 3), GOODPUT)
    clone = NightjarPolicy({"seed": 8})
    clone.load_state(original.state())
    assert clone.state() == original.state()
    a = [run_step(original, ctx(1 + i % 3), GOODPUT).gamma for i in range(200)]
    b = [run_step(clone, ctx(1 + i % 3), GOODPUT).gamma for i in range(200)]
    assert a == b


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: s.update(schema="other/1"),
        lambda s: s.update(gamma_max=3),
        lambda s: s["learners"]["engine:e"]["8"].update(means=[1.0]),
        lambda s: s["learners"]["engine:e"]["8"].update(means=[float("nan")] * 5),
        lambda s: s["engines"]["e"].pop("rng"),
    ],
)
def test_incompatible_state_is_rejected_and_changes_nothing(mutate: Any) -> None:
    policy = NightjarPolicy()
    good = exploit_state([1.0, 2.0, 3.0, 4.0, 5.0], previous_gamma=1)
    policy.load_state(good)
    bad = exploit_state([1.0, 2.0, 3.0, 4.0, 5.0], previous_gamma=1)
    mutate(bad)
    with pytest.raises(PolicyError):
        policy.load_state(bad)
    assert policy.state() == good


@pytest.mark.parametrize(
    "params",
    [
        {"gamma_max": 0},
        {"gamma_max": "4"},
        {"batch_bucketing": "log"},
        {"unknown": 1},
        {"max_batch_size": 0},
        {"prefill_cost_table": "does-not-exist.csv"},
    ],
)
def test_bad_parameters_are_rejected(params: dict[str, Any]) -> None:
    with pytest.raises(PolicyError):
        create_policy("nightjar", params)
