"""Property tests: Nightjar's bookkeeping holds for any sequence of steps."""

from __future__ import annotations

import math

from hypothesis import example, given, settings
from hypothesis import strategies as st

from nightjar_common.types import BinType, StepContext, StepOutcome
from policy_server.policies.nightjar import NightjarPolicy

steps = st.lists(
    st.tuples(
        st.integers(min_value=1, max_value=12),  # batch size
        st.booleans(),  # draft resident
        st.floats(min_value=0.0, max_value=5000.0, allow_nan=False),  # goodput
        st.booleans(),  # outcome reported
    ),
    max_size=300,
)


@settings(max_examples=60, deadline=None)
@given(steps=steps, seed=st.integers(min_value=0, max_value=2**32))
@example(steps=[(3, True, 100.0, True)] * 60, seed=0)  # reaches block 6 (H = 32)
def test_schedule_and_learner_invariants(
    steps: list[tuple[int, bool, float, bool]], seed: int
) -> None:
    policy = NightjarPolicy({"seed": seed, "gamma_max": 3, "max_batch_size": 8})
    rounds: dict[int, int] = {}
    reported: dict[tuple[int, int], list[float]] = {}
    for batch, resident, goodput, report in steps:
        ctx = StepContext("e", batch_size=batch, draft_resident=resident)
        choice = policy.decide(ctx)
        key = policy.context_key(batch)
        assert 0 <= choice.gamma <= 3
        if not resident:
            assert (choice.gamma, choice.bin_type) == (0, BinType.FORCED)
        else:
            rounds[key] = rounds.get(key, 0) + 1
            assert choice.bin_type in (BinType.EXPLORE, BinType.EXPLOIT)
            assert 0 < choice.exploration_probability <= 1
        if report:
            policy.observe(ctx, choice, StepOutcome("d", "e", choice.gamma, 1.0, int(goodput)))
            reported.setdefault((key, choice.gamma), []).append(float(int(goodput)))

    state = policy.state()
    schedules = state["engines"].get("e", {}).get("schedules", {})
    assert {int(k) for k in schedules} == set(rounds)
    for key, sched in schedules.items():
        h = sched["block_length"]
        assert h == 2 ** (sched["block"] - 1)
        assert 1 <= sched["round"] <= math.isqrt(h)
        assert 1 <= sched["bin"] <= math.isqrt(h)
        # Rounds completed so far equal the bandit decisions made in this context.
        done = sum(math.isqrt(2 ** (j - 1)) ** 2 for j in range(1, sched["block"]))
        per_bin = math.isqrt(h)
        assert done + (sched["bin"] - 1) * per_bin + sched["round"] - 1 == rounds[int(key)]
    learners = state["learners"].get("engine:e", {})
    for (key, gamma), rewards in reported.items():
        arms = learners[str(key)]
        assert arms["counts"][gamma] == len(rewards)
        assert math.isclose(arms["means"][gamma], sum(rewards) / len(rewards), rel_tol=1e-9)

    clone = NightjarPolicy({"seed": seed, "gamma_max": 3, "max_batch_size": 8})
    clone.load_state(state)
    assert clone.state() == state
