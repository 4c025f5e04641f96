"""The goodput policy's one-pass decide_candidates is CheckpointedDecide's loop, exactly.

For any learned state (warm-up or past it, with or without the local correction, a
switching-cost table, a TPOT SLO, trials pending, a new engine, a draft away) and any set of
candidate batch sizes, both give the same choice for every candidate and leave
the policy in the same state; restoring the same candidate's checkpoint from either leaves
the same state, and every decision after it is the same.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nightjar_common.types import BinType, Choice, StepContext
from policy_server.policies import goodput
from policy_server.policies.base import CheckpointedDecide, at_batch_size
from policy_server.policies.goodput import GoodputModelPolicy
from tests.policy_server.policies.test_goodput_policy import GAMMA_MAX, Environment

Decided = list[tuple[Choice, object]]

# Training batch sizes: small ones only (larger octaves are then unrun: trials), or spread.
TRAINING = ((4, 24, 32), (1, 3, 8, 64, 130))


class Bumpy(Environment):
    """As Environment, but each (batch-size octave, γ) runs up to 30 % off the smooth
    curve: the local correction's offsets differ from octave to octave."""

    def step_ms(self, batch: int, gamma: int, drafted: int | None = None) -> float:
        bump = (batch.bit_length() * 7 + gamma * 3) % 5 - 2
        return super().step_ms(batch, gamma, drafted) * (1.0 + 0.15 * bump)


@pytest.fixture(scope="module")
def prefill_cost_table(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("cost") / "c_prefill.csv"
    path.write_text(
        "lag_tokens,batch_size,c_prefill_ms\n"
        + "".join(f"{lag},{bs},{lag / 16}\n" for lag in (128, 4096) for bs in (4, 128))
    )
    return str(path)


def trained(
    params: dict[str, Any],
    steps: int,
    batches: tuple[int, ...],
    pending: int,
    env: Environment | None = None,
) -> GoodputModelPolicy:
    """A policy after ``steps`` decided and observed steps of engine "e" (learner key "k")
    in ``env``, then ``pending`` decisions at batch 256 whose outcomes have not come back
    (trials)."""
    policy = GoodputModelPolicy(params)
    env = env or Environment(alpha=0.7)
    for i in range(steps):
        ctx = train_context(batches[i % len(batches)], i)
        choice = policy.decide(ctx)
        policy.observe(ctx, choice, env.outcome(ctx, choice.gamma))
    for i in range(pending):
        policy.decide(train_context(256, steps + i))
    return policy


def train_context(batch: int, step: int) -> StepContext:
    return StepContext(
        "e",
        batch,
        step_index=step,
        max_gamma=GAMMA_MAX,
        learner_key="k",
        context_tokens=600 * batch,
        min_draft_passes=1,
    )


@st.composite
def policies(draw: st.DrawFn, table: str) -> GoodputModelPolicy:
    params = {
        "gamma_max": GAMMA_MAX,
        "seed": draw(st.integers(0, 3)),
        "warmup_steps": draw(st.sampled_from([0, 32])),
        "local_correction": draw(st.booleans()),
        "tpot_slo_ms": draw(st.sampled_from([0.0, 4.0, 8.0])),
        "explore_loss_cap": draw(st.sampled_from([0.02, 1.0])),
        "trial_loss_cap": draw(st.sampled_from([0.0, 0.2, 0.5])),
        "prefill_cost_table": draw(st.sampled_from(["", table])),
    }
    steps = draw(st.sampled_from([0, 12, 80, 240]))
    batches = draw(st.sampled_from(TRAINING))
    env = draw(st.sampled_from([Environment, Bumpy]))(alpha=0.7)
    return trained(params, steps, batches, draw(st.integers(0, 2)), env)


@st.composite
def asked(draw: st.DrawFn) -> tuple[StepContext, list[int]]:
    """A context (an engine known or new) and its candidate batch sizes, its own first."""
    batch = draw(st.integers(1, 300))
    ctx = StepContext(
        draw(st.sampled_from(["e", "e", "new"])),
        batch,
        step_index=10_000,
        max_draft_lag_tokens=draw(st.integers(0, 4096)),
        draft_resident=draw(st.booleans() | st.just(True)),
        previous_gamma=draw(st.none() | st.integers(0, GAMMA_MAX)),
        max_gamma=draw(st.sampled_from([0, 1, 2, GAMMA_MAX])),
        learner_key=draw(st.sampled_from(["k", ""])),
        context_tokens=draw(st.integers(0, 1000 * batch)),
        min_draft_passes=draw(st.integers(0, 1)),
    )
    others = draw(st.lists(st.integers(1, 300).filter(lambda b: b != batch), max_size=16))
    return ctx, [batch, *dict.fromkeys(others)]


def loop(policy: GoodputModelPolicy, ctx: StepContext, sizes: list[int]) -> Decided:
    """The default every checkpointing policy has: decide between checkpoints."""
    return CheckpointedDecide.decide_candidates(policy, ctx, sizes)


def follow(policy: GoodputModelPolicy, first: int) -> list[tuple[int, str]]:
    """Decisions after a commit: observed steps across batch sizes, then a candidate set."""
    env = Environment(alpha=0.6)
    chosen = []
    for i, batch in enumerate((first, 2, 48, 200, first, 9, 130, 17)):
        ctx = train_context(batch, 20_000 + i)
        choice = policy.decide(ctx)
        policy.observe(ctx, choice, env.outcome(ctx, choice.gamma))
        chosen.append((choice.gamma, choice.bin_type.value))
    ctx = train_context(first, 30_000)
    decided = policy.decide_candidates(ctx, [first, first + 1, 2 * first, 100])
    policy.restore(train_context(100, 30_000), decided[-1][1])
    chosen += [(choice.gamma, choice.bin_type.value) for choice, _ in decided]
    return chosen


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_one_pass_decides_and_checkpoints_as_the_loop(
    data: st.DataObject, prefill_cost_table: str
) -> None:
    policy = data.draw(policies(prefill_cost_table), label="policy")
    ctx, sizes = data.draw(asked(), label="asked")
    looped, one_pass = copy.deepcopy(policy), copy.deepcopy(policy)

    expected = loop(looped, ctx, sizes)
    got = one_pass.decide_candidates(ctx, sizes)

    assert [choice for choice, _ in got] == [choice for choice, _ in expected]
    assert one_pass.state() == looped.state()  # neither changed what counts

    chosen = data.draw(st.integers(0, len(sizes) - 1), label="chosen")
    candidate = at_batch_size(ctx, sizes[chosen])
    looped.restore(candidate, expected[chosen][1])
    one_pass.restore(candidate, got[chosen][1])
    assert one_pass.state() == looped.state()
    assert follow(one_pass, candidate.batch_size) == follow(looped, candidate.batch_size)
    assert one_pass.state() == looped.state()


def test_candidates_share_one_draw_and_only_the_drawing_ones_advance_the_rng() -> None:
    """Past warm-up, in a trained octave: every candidate draws (the RNG of each checkpoint
    is one draw on); at an untried octave a trial draws nothing."""
    policy = trained({"gamma_max": GAMMA_MAX, "seed": 1}, 300, TRAINING[0], pending=0)
    ctx = train_context(24, 1_000)
    before = policy.state("e")["engines"]["e"]
    decided = policy.decide_candidates(ctx, [24, 25, 26, 500])
    assert policy.state("e")["engines"]["e"] == before
    states = []
    for index in range(len(decided)):
        # A copy of the policy with the checkpoints, which hold its engine record.
        probe, candidates = copy.deepcopy((policy, decided))
        _, after = candidates[index]
        probe.restore(ctx, after)
        states.append(probe.state("e")["engines"]["e"])
    assert states[0]["rng"] == states[1]["rng"] == states[2]["rng"] != before["rng"]
    trial = decided[3][0]
    assert trial.bin_type is BinType.EXPLORE and states[3]["rng"] == before["rng"]
    assert states[3]["trials"] == sorted([*before["trials"], [8, trial.gamma]])
    assert [s["previous_gamma"] for s in states] == [c.gamma for c, _ in decided]


@pytest.mark.parametrize("seed", range(4))
def test_a_set_across_every_octave_decides_as_the_loop(seed: int) -> None:
    """Candidates in every octave trained with offsets of their own (Bumpy): each is priced
    with its octave's correction, point and drawn."""
    params = {"gamma_max": GAMMA_MAX, "seed": seed, "explore_loss_cap": 1.0}
    policy = trained(params, 400, TRAINING[1], 0, Bumpy(alpha=0.7))
    ctx = train_context(64, 1_000)
    sizes = [64, *range(1, 300, 5)]
    expected = loop(copy.deepcopy(policy), ctx, sizes)
    got = policy.decide_candidates(ctx, sizes)
    assert [choice for choice, _ in got] == [choice for choice, _ in expected]


def test_a_draw_is_priced_only_where_the_cap_lets_it_change_a_choice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where no γ but the greedy one is within the exploration cap, the cap takes any drawn
    γ back to the greedy one, so a table leaves the draw unpriced there. Over a run that
    meets both (tables with near-ties and without), every choice of every table, and so
    the RNG stream, is what pricing the draw always gives."""
    seen: list[bool] = []
    contested = goodput._contested

    def spied(*args: Any) -> bool:
        seen.append(contested(*args))
        return seen[-1]

    def run() -> list[list[tuple[int, BinType]]]:
        policy = GoodputModelPolicy({"gamma_max": GAMMA_MAX, "seed": 1, "warmup_steps": 0})
        env = Bumpy(alpha=0.7)
        tables = []
        for i in range(300):
            batch = (4, 24, 32, 64, 128)[i % 5]
            ctx = train_context(batch, i)
            low = max(1, batch - 8)
            decided = policy.decide_candidates(ctx, list(range(low, batch + 9)))
            choice, after = decided[batch - low]
            policy.restore(ctx, after)
            policy.observe(ctx, choice, env.outcome(ctx, choice.gamma))
            tables.append([(c.gamma, c.bin_type) for c, _ in decided])
        return tables

    monkeypatch.setattr(goodput, "_contested", spied)
    skipping = run()
    assert True in seen and False in seen
    assert any(kind is BinType.EXPLORE for table in skipping for _, kind in table)
    monkeypatch.setattr(goodput, "_contested", lambda *args: True)
    assert run() == skipping
