"""The goodput policy's per-sequence mode (``per_request``): per-request acceptance shrunk
to the pooled estimate, a γ per request under the batch cap, its state and its bounds; off,
the per-batch decisions whatever the engine sends (docs/POLICIES.md, "Per-request mode").

The environment is synthetic: each request accepts at its own α, and a step costs
6 ms + 0.5 ms per verified token + (0.8 + 0.01·B) ms per draft pass of the cap, so a draft
token of a request that rarely accepts is not worth verifying while one of a request that
nearly always does is. The batch size cycles: at one batch size alone, steps of one γ for
all cannot tell the cost of a verified token from that of a draft pass (both grow with γ
alone), and the regression would split them by its ridge.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import random
from typing import Any

import numpy as np
import pytest

from nightjar_common.types import BinType, Choice, RequestSignals, StepContext, StepOutcome
from policy_server.policies import PolicyError, goodput
from policy_server.policies.base import CheckpointedDecide, at_batch_size
from policy_server.policies.goodput import GoodputModelPolicy
from policy_server.policies.models import step_features, verify_features
from policy_server.policies.per_request import (
    MAX_REQUESTS,
    RequestRecord,
    prune,
    records_from_json,
    shrunk_alpha,
    touch,
)

GAMMA_MAX = 4
CONTEXT = 600
# Requests that nearly always accept and requests that rarely do.
MIXED = {**{f"hi{i}": 0.9 for i in range(8)}, **{f"lo{i}": 0.3 for i in range(8)}}
# Per step, this many requests of each kind (batch sizes 4, 8, 16).
HALVES = (2, 4, 8)


def step_ms(batch: int, cap: int, verified: int) -> float:
    return 6.0 + 0.5 * (batch + verified) + cap * (0.8 + 0.01 * batch)


def request_context(ids: list[str], step: int) -> StepContext:
    return StepContext(
        "e",
        len(ids),
        step_index=step,
        max_gamma=GAMMA_MAX,
        context_tokens=CONTEXT * len(ids),
        requests=tuple(RequestSignals(rid, CONTEXT) for rid in ids),
    )


def outcome(
    ctx: StepContext, choice: Choice, alphas: dict[str, float], rng: random.Random
) -> StepOutcome:
    """Each request accepts a run at its own α up to its γ_i; labelled accepts of those
    that verified drafts."""
    planned = dict(choice.request_gammas)
    ids, accepts, verified = [], [], 0
    for request in ctx.requests:
        gamma = planned.get(request.request_id, choice.gamma)
        alpha = alphas[request.request_id]
        draws = (rng.random() < alpha for _ in range(gamma))
        run = sum(1 for _ in itertools.takewhile(bool, draws))
        verified += gamma
        if gamma > 0:
            ids.append(request.request_id)
            accepts.append(run)
    seconds = step_ms(ctx.batch_size, choice.gamma, verified) * rng.uniform(0.98, 1.02) / 1000
    return StepOutcome(
        "d",
        "e",
        choice.gamma,
        seconds,
        sum(accepts) + ctx.batch_size,
        drafted_tokens=verified,
        accepted_tokens=sum(accepts),
        request_accepts=tuple(accepts),
        request_ids=tuple(ids),
    )


def drive(
    policy: GoodputModelPolicy,
    alphas: dict[str, float],
    steps: int,
    seed: int = 1,
    start: int = 0,
) -> list[Choice]:
    rng = random.Random(seed)
    ids = list(alphas)
    chosen = []
    for i in range(start, start + steps):
        ctx = request_context(batch_of(ids, i), i)
        choice = policy.decide(ctx)
        policy.observe(ctx, choice, outcome(ctx, choice, alphas, rng))
        chosen.append(choice)
    return chosen


def batch_of(ids: list[str], step: int) -> list[str]:
    """The step's requests: the first n of each half of ``ids`` (n cycling over HALVES)."""
    half, n = len(ids) // 2, HALVES[step % len(HALVES)]
    return ids[:n] + ids[half : half + n] if half >= n else ids


def per_request(**params: Any) -> GoodputModelPolicy:
    return GoodputModelPolicy({"gamma_max": GAMMA_MAX, "seed": 3, "per_request": True, **params})


def test_the_flag_says_whether_the_engine_should_send_request_signals() -> None:
    assert per_request().reads_request_signals
    # "auto" (the default) learns from them whether to plan per request.
    assert GoodputModelPolicy({"gamma_max": GAMMA_MAX}).reads_request_signals
    off = GoodputModelPolicy({"gamma_max": GAMMA_MAX, "per_request": False})
    assert not off.reads_request_signals


@pytest.mark.parametrize(
    "params",
    [
        {"per_request": True, "tpot_slo_ms": 30.0},
        {"request_prior_weight": 0.0},
        {"request_idle_steps": 0},
        {"per_request": 1},
    ],
)
def test_bad_per_request_parameters_are_refused(params: dict[str, Any]) -> None:
    with pytest.raises(PolicyError):
        GoodputModelPolicy({"gamma_max": GAMMA_MAX, **params})


def test_a_young_request_follows_the_pooled_estimate_and_an_old_one_its_own() -> None:
    assert shrunk_alpha(None, 0.6, 12.0) == 0.6
    young = RequestRecord(successes=1.0, failures=1.0, last_seen=0)
    old = RequestRecord(successes=900.0, failures=100.0, last_seen=0)
    assert abs(shrunk_alpha(young, 0.6, 12.0) - 0.6) < 0.02
    assert abs(shrunk_alpha(old, 0.6, 12.0) - 0.9) < 0.01


def test_a_batch_of_requests_never_seen_decides_as_the_per_batch_policy() -> None:
    """Every request at the pooled α: the plan is the batch γ of the same learned state
    and draw (no per-request γ)."""
    trained = per_request()
    drive(trained, MIXED, 300)
    batch = GoodputModelPolicy({"gamma_max": GAMMA_MAX, "seed": 3})
    batch.load_state(json.loads(json.dumps(trained.state())))
    for step in range(300, 340):
        ctx = request_context([f"new{step}-{i}" for i in range(8)], step)
        mine, theirs = trained.decide(ctx), batch.decide(ctx)
        assert mine.request_gammas == ()
        assert (mine.gamma, mine.bin_type) == (theirs.gamma, theirs.bin_type)


def test_a_request_that_accepts_little_gets_a_shorter_gamma_in_the_same_batch() -> None:
    policy = per_request()
    # This environment's batch steps split a step's cost between verified tokens and draft
    # passes slowly (the module's note): hundreds of steps pass before the plans settle.
    chosen = drive(policy, MIXED, 800)[-200:]
    planned = [dict(c.request_gammas) for c in chosen if c.request_gammas]
    assert len(planned) >= 180  # nearly every step after warm-up answers per request
    high = np.mean([gamma for g in planned for rid, gamma in g.items() if rid.startswith("hi")])
    low = np.mean([gamma for g in planned for rid, gamma in g.items() if rid.startswith("lo")])
    assert high >= 2.0 and low <= 1.0
    assert all(c.gamma == max(dict(c.request_gammas).values()) for c in chosen if c.request_gammas)


def test_a_decision_searches_one_plan_and_explores_as_a_batch_gamma(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The plan is the point estimate's, searched once, for a row whose batch γ exploits;
    a row that explores (a draw away from the greedy γ, or a trial) runs that batch γ."""
    policy = per_request()
    drive(policy, MIXED, 300)
    searches: list[int] = []
    search = goodput.best_plan

    def counted(*args: Any) -> Any:
        searches.append(1)
        return search(*args)

    monkeypatch.setattr(goodput, "best_plan", counted)
    rng = random.Random(2)
    kinds = []
    for step in range(300, 700):
        searches.clear()
        ctx = request_context(batch_of(list(MIXED), step), step)
        choice = policy.decide(ctx)
        policy.observe(ctx, choice, outcome(ctx, choice, MIXED, rng))
        assert len(searches) == (choice.bin_type is BinType.EXPLOIT)
        if choice.request_gammas:
            assert choice.bin_type is BinType.EXPLOIT
        kinds.append((choice.bin_type, bool(choice.request_gammas)))
    assert (BinType.EXPLORE, False) in kinds and (BinType.EXPLOIT, True) in kinds


def test_off_the_engines_request_signals_change_no_decision() -> None:
    """The per-batch default, bit for bit: contexts with requests and labelled accepts
    decide and learn exactly as contexts without them."""
    params = {"gamma_max": GAMMA_MAX, "seed": 5, "per_request": False}
    policies = [GoodputModelPolicy(params) for _ in range(2)]
    rng = [random.Random(2), random.Random(2)]
    ids = list(MIXED)
    for step in range(400):
        ctx = request_context(batch_of(ids, step), step)
        plain = dataclasses.replace(ctx, requests=())
        signals, batch = policies[0].decide(ctx), policies[1].decide(plain)
        assert signals == batch
        labelled = outcome(ctx, signals, MIXED, rng[0])
        unlabelled = outcome(ctx, batch, MIXED, rng[1])
        policies[0].observe(ctx, signals, labelled)
        policies[1].observe(plain, batch, dataclasses.replace(unlabelled, request_ids=()))
    assert policies[0].state() == policies[1].state()
    assert policies[0].state()["engines"]["e"]["requests"] == {}


def test_state_round_trips_with_the_request_records_and_decisions_continue() -> None:
    policy = per_request()
    drive(policy, MIXED, 200)
    state = json.loads(json.dumps(policy.state()))
    assert set(state["engines"]["e"]["requests"]) == set(MIXED)
    copy_ = per_request()
    copy_.load_state(state)
    assert copy_.state() == policy.state()
    assert drive(copy_, MIXED, 60, seed=9, start=200) == drive(policy, MIXED, 60, seed=9, start=200)


def test_a_goodput_3_state_loads_without_request_records() -> None:
    policy = per_request()
    drive(policy, MIXED, 100)
    old = json.loads(json.dumps(policy.state()))
    old["schema"] = "goodput/3"
    for engine in old["engines"].values():
        del engine["requests"], engine["observed_steps"]
    restored = per_request()
    restored.load_state(old)
    assert restored.state()["engines"]["e"]["requests"] == {}


@pytest.mark.parametrize("record", [[-1.0, 0.0, 1], [1.0, float("inf"), 1], [1.0, 1.0, 10**9]])
def test_malformed_request_records_are_refused_and_change_nothing(record: list[float]) -> None:
    policy = per_request()
    drive(policy, MIXED, 60)
    before = policy.state()
    broken = json.loads(json.dumps(before))
    broken["engines"]["e"]["requests"]["hi0"] = record
    with pytest.raises(PolicyError):
        policy.load_state(broken)
    assert policy.state() == before


def test_requests_no_longer_seen_are_forgotten() -> None:
    """Finished requests leave after ``request_idle_steps`` steps of their engine."""
    policy = per_request(request_idle_steps=10)
    rng = random.Random(4)
    for step in range(200):
        # Half the batch lives 3 steps, the other half the whole run.
        ids = [f"short{step // 3}-{i}" for i in range(4)] + [f"long{i}" for i in range(4)]
        ctx = request_context(ids, step)
        choice = policy.decide(ctx)
        policy.observe(ctx, choice, outcome(ctx, choice, dict.fromkeys(ids, 0.7), rng))
    kept = policy.state()["engines"]["e"]["requests"]
    assert {f"long{i}" for i in range(4)} <= set(kept)
    assert len(kept) <= 4 + 4 * (10 // 3 + 2)


def test_a_named_request_that_verified_no_draft_is_kept_while_it_runs() -> None:
    """A request the context names but the outcome does not label (it verified no draft)
    is still running: seen, not pruned as idle, while a finished one is."""
    policy = per_request(request_idle_steps=5)
    labelled, quiet = ("a", "b"), "quiet"
    first = request_context([*labelled, quiet, "done"], 0)
    policy.observe(first, Choice(2, BinType.EXPLOIT), labelled_outcome((*labelled, quiet, "done")))
    for step in range(1, 20):
        ctx = request_context([*labelled, quiet], step)
        policy.observe(ctx, Choice(2, BinType.EXPLOIT), labelled_outcome(labelled))
    kept = policy.state()["engines"]["e"]["requests"]
    assert set(kept) == {*labelled, quiet}
    assert kept[quiet][2] == kept["a"][2] == 20  # last seen at the engine's latest step


def labelled_outcome(ids: tuple[str, ...]) -> StepOutcome:
    """A step at γ 2 whose ``ids`` each accepted one draft."""
    return StepOutcome(
        "d",
        "e",
        2,
        0.01,
        2 * len(ids),
        drafted_tokens=2 * len(ids),
        accepted_tokens=len(ids),
        request_accepts=(1,) * len(ids),
        request_ids=ids,
    )


def test_an_engine_keeps_at_most_max_requests_records_the_newest() -> None:
    records = {str(i): RequestRecord(1.0, 1.0, i) for i in range(MAX_REQUESTS + 100)}
    prune(records, MAX_REQUESTS + 99, idle_steps=10**6)
    assert len(records) == MAX_REQUESTS and min(int(rid) for rid in records) == 100


def test_loaded_records_are_pruned_by_when_they_were_last_seen() -> None:
    """A state may list its records in any order; pruning, which drops from the front of
    the order last seen, still drops exactly the idle ones."""
    listed = {
        "late": [1.0, 0.0, 90],
        "back": [1.0, 0.0, 5],
        "recent": [1.0, 0.0, 60],
        "gone": [1.0, 0.0, 20],
    }
    records = records_from_json(listed, observed_steps=100)
    touch(records, ["back"], 100)  # seen again: no longer idle
    prune(records, 100, idle_steps=50)
    assert list(records) == ["recent", "late", "back"]


def test_a_uniform_plans_features_are_the_batch_steps() -> None:
    rows = verify_features(8, np.array([3.0]), np.array([24.0]), np.array([3.0]), 4800, 100)
    assert rows[0].tolist() == step_features(8, 3, 100, 4800).tolist()


def test_candidates_in_one_pass_decide_and_checkpoint_as_the_loop() -> None:
    """The plan goes to the candidate whose size the requests make up, in both paths."""
    policy = per_request()
    drive(policy, MIXED, 600)
    ctx = request_context(list(MIXED), 600)
    sizes = [16, 15, 17, 64]
    looped, one_pass = copy.deepcopy(policy), copy.deepcopy(policy)
    expected = CheckpointedDecide.decide_candidates(looped, ctx, sizes)
    got = one_pass.decide_candidates(ctx, sizes)
    assert [c for c, _ in got] == [c for c, _ in expected]
    assert got[0][0].request_gammas and not any(c.request_gammas for c, _ in got[1:])
    looped.restore(at_batch_size(ctx, 16), expected[0][1])
    one_pass.restore(at_batch_size(ctx, 16), got[0][1])
    assert one_pass.state() == looped.state()
