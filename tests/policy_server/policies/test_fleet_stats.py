"""Fleet learning's algorithm (policy_server/policies/fleet_stats.py): each sidecar's own
evidence is counted once in every pooled learner, across merges, restarts and imports."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest

from nightjar_common.types import BinType, Choice, StepContext, StepOutcome
from policy_server.policies import REGISTRY, create_policy
from policy_server.policies.fleet_stats import GoodputStats, Pooling, pooling
from policy_server.policies.goodput import GoodputModelPolicy

KEY = "llama-8b@h100/eagle/tp1"
LEARNER = f"shared:{KEY}"


def _policy(**params: Any) -> GoodputModelPolicy:
    policy = create_policy("goodput", params)
    assert isinstance(policy, GoodputModelPolicy)
    return policy


def _run(policy: GoodputModelPolicy, engine: str, steps: int, seed: int, alpha: float) -> None:
    """``steps`` decided steps of a simulated engine: per-request accepts drawn with
    acceptance ``alpha``, step time linear in the tokens and draft passes."""
    rng = random.Random(seed)
    for _ in range(steps):
        batch = rng.choice((1, 2, 4, 8, 16, 32))
        ctx = StepContext(engine, batch, learner_key=KEY, context_tokens=300 * batch)
        choice = policy.decide(ctx)
        gamma = choice.gamma
        accepts = []
        for _ in range(batch if gamma else 0):
            k = 0
            while k < gamma and rng.random() < alpha:
                k += 1
            accepts.append(k)
        ms = 6.0 + 0.04 * batch * (gamma + 1) + 1.5 * gamma
        outcome = StepOutcome(
            f"d{rng.random()}",
            engine,
            gamma,
            ms * rng.uniform(0.95, 1.05) / 1000.0,
            batch + sum(accepts),
            drafted_tokens=gamma * batch,
            accepted_tokens=sum(accepts),
            request_accepts=tuple(accepts),
        )
        policy.observe(ctx, choice, outcome)


def _close(a: GoodputStats, b: GoodputStats, residuals: bool = True) -> None:
    """Equal statistics; without ``residuals`` the squared residuals are left out (they
    are measured against the fit in use, which pooling moves)."""
    assert a.steps == b.steps
    np.testing.assert_allclose(a.acceptance, b.acceptance, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(a.gram, b.gram, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(a.moment, b.moment, rtol=1e-9, atol=1e-12)
    used = slice(None) if residuals else slice(0, 2)
    np.testing.assert_allclose(a.sums[used], b.sums[used], rtol=1e-9, atol=1e-12)
    assert sorted(a.correction) == sorted(b.correction)
    for octave, block in a.correction.items():
        np.testing.assert_allclose(block, b.correction[octave], rtol=1e-9, atol=1e-9)


def _local(policy: GoodputModelPolicy, member: str) -> GoodputStats:
    stats = policy.local_evidence(LEARNER, member)
    assert stats is not None
    return stats


def test_only_goodput_pools_the_others_say_they_cannot() -> None:
    poolers = [name for name in REGISTRY if pooling(create_policy(name, {})) is not None]
    assert poolers == ["goodput"]
    assert isinstance(_policy(), Pooling)


def test_local_evidence_is_what_this_sidecar_learned_across_merges() -> None:
    """A learner that merged fleet evidence midway reports as its own exactly what a
    learner that never pooled learned from the same steps (decays included)."""
    pooled, alone, other = _policy(), _policy(), _policy()
    _run(other, "e-other", 300, seed=9, alpha=0.8)
    _run(pooled, "e1", 200, seed=1, alpha=0.7)
    _run(alone, "e1", 200, seed=1, alpha=0.7)
    _close(_local(pooled, "a"), _local(alone, "a"))
    pooled.merge_fleet(LEARNER, _local(other, "b"), "a", {"a", "b"})
    # The same decisions need not follow (the fleet moved the model): observe alike, with
    # per-request accepts (batch totals are split by the current α: not the same then).
    for policy in (pooled, alone):
        rng = random.Random(3)
        for i in range(150):
            batch = rng.choice((1, 4, 16))
            ctx = StepContext("e1", batch, learner_key=KEY, context_tokens=100 * batch)
            gamma = rng.randint(0, 4)
            accepts = tuple(rng.randint(0, gamma) for _ in range(batch if gamma else 0))
            outcome = StepOutcome(
                f"x{i}",
                "e1",
                gamma,
                0.01 + 0.001 * gamma,
                batch + sum(accepts),
                gamma * batch,
                sum(accepts),
                request_accepts=accepts,
            )
            policy.observe(ctx, Choice(gamma, BinType.EXPLOIT), outcome)
    _close(_local(pooled, "a"), _local(alone, "a"), residuals=False)


def test_merging_again_counts_nothing_twice() -> None:
    """Merges repeated with the same fleet evidence leave the learner as one merge left it;
    its pooled acceptance counts are the prior's, its own and the fleet's, once each."""
    a, b = _policy(acceptance_window_steps=10_000_000), _policy(acceptance_window_steps=10_000_000)
    _run(a, "ea", 120, seed=1, alpha=0.9)
    _run(b, "eb", 80, seed=2, alpha=0.5)
    local_a, local_b = _local(a, "a"), _local(b, "b")
    for _ in range(5):
        a.merge_fleet(LEARNER, _local(b, "b"), "a", {"a", "b"})
        b.merge_fleet(LEARNER, _local(a, "a"), "b", {"a", "b"})
    _close(_local(a, "a"), local_a)
    _close(_local(b, "b"), local_b)
    learner = a._book.learners[LEARNER]
    prior = learner.fleet.prior  # type: ignore[union-attr]
    counts = np.array([learner.acceptance.successes, learner.acceptance.failures])
    np.testing.assert_allclose(counts, prior + local_a.acceptance + local_b.acceptance)
    assert learner.steps == 200
    assert a.evidence(LEARNER) == (local_a.summary(), local_b.summary())


def test_a_new_sidecar_decides_from_the_fleet_not_the_prior() -> None:
    warm, new = _policy(), _policy()
    _run(warm, "ew", 400, seed=4, alpha=0.85)
    new.merge_fleet(LEARNER, _local(warm, "w"), "n", {"w", "n"})
    for batch in (1, 4, 16, 64):
        ctx = StepContext("probe", batch, learner_key=KEY, context_tokens=300 * batch)
        want = int(np.argmax(warm.predicted_goodput(LEARNER, ctx)))
        assert int(np.argmax(new.predicted_goodput(LEARNER, ctx))) == want
    # Past the warm-up (the prior table's γ = 0 at 64 and γ = 1 at 16): the model decides.
    assert new._book.learners[LEARNER].steps == 400
    cold = _policy()
    cold_ctx = StepContext("probe", 64, learner_key=KEY, context_tokens=300 * 64)
    assert cold.decide(cold_ctx).gamma == 0
    assert new.decide(cold_ctx).gamma == warm.decide(cold_ctx).gamma


def test_a_restart_replaces_its_contribution_instead_of_adding_it() -> None:
    """The snapshot carries the share: restored, the learner's own part is what it was,
    and another merge of the same fleet evidence changes nothing."""
    a, b = _policy(), _policy()
    _run(a, "ea", 150, seed=5, alpha=0.8)
    _run(b, "eb", 150, seed=6, alpha=0.6)
    a.merge_fleet(LEARNER, _local(b, "b"), "a", {"a", "b"})
    _run(a, "ea", 40, seed=7, alpha=0.8)
    before = _local(a, "a")
    restarted = _policy()
    restarted.load_state(json.loads(json.dumps(a.state())))
    _close(_local(restarted, "a"), before)
    restarted.merge_fleet(LEARNER, _local(b, "b"), "a", {"a", "b"})
    _close(_local(restarted, "a"), before)
    state = restarted.state()["learners"][LEARNER]["fleet"]
    assert state["member"] == "a"
    assert state["evidence"]["fleet"]["steps"] == 150
    assert state["evidence"]["local"]["steps"] == 190


def test_an_imported_learner_gives_its_evidence_back_to_its_owner() -> None:
    """A learner carried from member "a" (nightjarctl import, a copied snapshot) does not
    publish a's evidence as its own, and drops it while "a" publishes it; adopts it once
    "a" has left."""
    a = _policy()
    _run(a, "ea", 100, seed=8, alpha=0.8)
    a.merge_fleet(LEARNER, GoodputStats.zero(), "a", {"a"})
    local_a = _local(a, "a")
    copy = _policy()
    copy.load_state(json.loads(json.dumps(a.state())))
    assert copy.local_evidence(LEARNER, "c") is None
    copy.merge_fleet(LEARNER, local_a, "c", {"a", "c"})
    assert _local(copy, "c").steps == 0
    assert copy._book.learners[LEARNER].steps == 100
    orphan = _policy()
    orphan.load_state(json.loads(json.dumps(a.state())))
    orphan.merge_fleet(LEARNER, GoodputStats.zero(), "c", {"c"})
    _close(_local(orphan, "c"), local_a)


def test_fleet_evidence_is_forgotten_at_the_learners_own_steps() -> None:
    """Between merges the fleet's part decays with the learner's steps, as its own does."""
    a, b = _policy(acceptance_window_steps=16), _policy()
    _run(b, "eb", 100, seed=1, alpha=0.5)
    a.merge_fleet(LEARNER, _local(b, "b"), "a", {"a", "b"})
    _, fleet_before = a.evidence(LEARNER)
    _run(a, "ea", 200, seed=2, alpha=0.9)
    _, fleet_after = a.evidence(LEARNER)
    assert fleet_after["acceptance_tokens"] < 0.01 * fleet_before["acceptance_tokens"]
    assert a._book.learners[LEARNER].acceptance.alpha > 0.8


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda d: d.update(schema="goodput-stats/0"),
        lambda d: d.update(acceptance=[1.0]),
        lambda d: d.update(acceptance=[-1.0, 2.0]),
        lambda d: d["gram"][0].__setitem__(0, float("nan")),
        lambda d: d.update(moment="x"),
        lambda d: d.update(steps=-1),
        lambda d: d.update(steps=True),
        lambda d: d.update(correction=[[0, 9, *([0.0] * 16)]]),
        lambda d: d.update(correction=[[99, 1, *([0.0] * 16)]]),
        lambda d: d.update(correction=[[0, 1, 1.0]]),
        lambda d: d.update(sums=[1e300, 0.0, 0.0]),
        lambda d: d.pop("gram"),
    ],
)
def test_malformed_statistics_are_refused(corrupt: Any) -> None:
    policy = _policy()
    _run(policy, "e", 50, seed=1, alpha=0.7)
    data = json.loads(json.dumps(_local(policy, "a").to_json()))
    policy.stats_from_json(data)  # well formed as published
    corrupt(data)
    with pytest.raises((ValueError, TypeError, KeyError)):
        policy.stats_from_json(data)
