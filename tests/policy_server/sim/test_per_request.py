"""Per-sequence γ in the simulator: the step model, the mixed population, the decision path
and `dsde` end to end (docs/SIMULATOR.md, "Per-sequence γ")."""

from __future__ import annotations

import random
import statistics
from typing import ClassVar

import nightjar_data
import pytest

from nightjar_common.types import StepContext, StepOutcome
from policy_server.sim.acceptance import MIXES, WORKLOADS, AcceptanceModel, expected_tokens
from policy_server.sim.engine import Decided, DecisionSource, SimConfig, SimResult, Simulator
from policy_server.sim.profile import Verification, builtin_profiles
from policy_server.sim.runs import MIXED, BenchConfig, acceptance_of, mixed_workloads, workloads
from policy_server.sim.sources import PolicySource, RequestOracleSource
from policy_server.sim.workload import RatePhase, read_trace, synthetic

DATA = nightjar_data.ROOT
PROFILE = builtin_profiles(DATA / "calibration")["llama2-7b-a100"]
TRACE = read_trace(DATA / "traces" / "azure_llm_2023_conv.csv")
SPECS = synthetic([RatePhase(20, 4.0)], TRACE, seed=7)
MIX = MIXES["code-writing"]


class Scripted:
    """A batch γ and, per request, γ_i = ``even`` for even rids and the cap for odd ones;
    records what the engine reported back."""

    per_request = True

    def __init__(self, cap: int, even: int | None) -> None:
        self.cap, self.even = cap, even
        self.contexts: list[StepContext] = []
        self.outcomes: list[StepOutcome] = []
        self.given: dict[str, int] = {}

    def decide(self, ctx: StepContext, sim: Simulator) -> Decided:
        self.contexts.append(ctx)
        if self.even is None:
            return Decided(self.cap, "d")
        answer = tuple(
            (r.request_id, self.even if int(r.request_id) % 2 == 0 else self.cap)
            for r in ctx.requests
        )
        self.given = dict(answer)
        return Decided(self.cap, "d", answer)

    def report(self, ctx: StepContext, decision_id: str, outcome: StepOutcome) -> None:
        self.outcomes.append(outcome)


class Batch:
    """The static policy through a source without per-request signals."""

    per_request = False

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma

    def decide(self, ctx: StepContext, sim: Simulator) -> Decided:
        return Decided(self.gamma)

    def report(self, ctx: StepContext, decision_id: str, outcome: StepOutcome) -> None:
        return None


def simulate(source: DecisionSource) -> SimResult:
    config = SimConfig(seed=3, gamma_max=4, track_regret=True)
    return Simulator(PROFILE, MIX, SPECS, source, config).run()


# -- the step model ----------------------------------------------------------------------------


def test_verify_work_follows_the_sum_of_request_tokens_and_drafting_the_cap() -> None:
    batch, contexts = 4, [300, 500, 700, 900]
    uniform = Verification.of([2] * batch, contexts)
    assert uniform == Verification(8, 2.0)
    # All γ_i = 2 under a cap of 4: the verify of γ = 2, plus two more draft passes.
    capped = PROFILE.step_seconds(batch, 4, 0, sum(contexts), 0, uniform)
    extra_passes = 2 * PROFILE.draft_pass_ms(batch) / 1000
    assert capped == pytest.approx(PROFILE.step_seconds(batch, 2, 0, sum(contexts)) + extra_passes)
    # Each draft pass more of the cap costs one pass over the batch, the verify unchanged.
    mixed = Verification.of([1, 3, 1, 3], contexts)
    step = [PROFILE.step_seconds(batch, cap, 0, sum(contexts), 0, mixed) for cap in (3, 4)]
    assert step[1] - step[0] == pytest.approx(PROFILE.draft_pass_ms(batch) / 1000)
    # Fewer verified tokens under the same cap: a cheaper step.
    fewer = Verification.of([0, 1, 0, 1], contexts)
    assert PROFILE.step_seconds(batch, 3, 0, sum(contexts), 0, fewer) < step[0]
    # The extra query tokens re-read each request's own KV: γ_i weighted by context.
    assert Verification.of([0, 4], [100, 300]).attention_gamma == pytest.approx(3.0)


def test_a_request_verifies_at_most_its_own_gamma_and_the_outcome_counts_them() -> None:
    source = Scripted(cap=4, even=1)
    result = simulate(source)
    assert all(r.generated == r.spec.output_tokens for r in result.requests)  # tokens conserved
    seen = {0: 0, 1: 0}
    for ctx in source.contexts:
        for request in ctx.requests:
            assert request.kl_divergence is None  # the simulator has no distributions
            parity = int(request.request_id) % 2
            assert all(a <= (1 if parity == 0 else 4) for a in request.recent_accepts)
            seen[parity] = max(seen[parity], *request.recent_accepts, 0)
    assert seen == {0: 1, 1: 4}  # both ran their γ_i in full sometimes
    decode_steps = [o for o in source.outcomes if o.request_accepts]
    assert decode_steps
    for ctx, outcome in zip(source.contexts, source.outcomes, strict=True):
        # Each accept labelled with its request (here every request verifies γ_i >= 1).
        assert outcome.request_ids == tuple(r.request_id for r in ctx.requests)
        assert len(outcome.request_accepts) == len(outcome.request_ids)
    for outcome in decode_steps:
        assert outcome.accepted_tokens == sum(outcome.request_accepts)
        assert outcome.drafted_tokens < 4 * len(outcome.request_accepts)  # Σ γ_i, not B·cap
        assert outcome.gamma == 4


def test_the_token_budget_counts_each_requests_own_verify_tokens() -> None:
    """vLLM's synchronous scheduler schedules 1 + len(spec_token_ids) tokens a request, the
    drafts already cut to γ_i: what a request does not verify is left to prefill chunks
    (before, the simulator kept the cap's tokens for every request)."""
    budget, cap = 64, 4
    source = Scripted(cap=cap, even=0)
    config = SimConfig(max_running=8, max_batch_tokens=budget, gamma_max=cap, seed=3)
    result = Simulator(PROFILE, MIX, SPECS[:40], source, config).run()
    assert not any(r.preemptions for r in result.requests)  # each step decoded its context's
    steps = list(zip(source.contexts, source.outcomes, strict=True))
    for ctx, outcome in steps:
        assert outcome.prefill_tokens <= budget - ctx.batch_size - outcome.drafted_tokens
    roomier = [
        outcome
        for ctx, outcome in steps
        if outcome.prefill_tokens > max(0, budget - ctx.batch_size * (cap + 1))
    ]
    assert roomier


def test_lower_request_gammas_make_the_same_batch_cap_cheaper_per_step() -> None:
    """Same cap, same arrivals: requests that verify less make each step shorter."""
    full, short = simulate(Scripted(cap=4, even=None)), simulate(Scripted(cap=4, even=0))
    mean_step = [statistics.fmean(s.step_s for s in r.steps if s.batch_size) for r in (full, short)]
    assert mean_step[1] < mean_step[0]


def test_request_gammas_at_the_cap_are_the_batch_model() -> None:
    every = Scripted(cap=3, even=3)
    batch = simulate(Batch(3))
    per_request = simulate(every)
    assert [s.generated for s in per_request.steps] == [s.generated for s in batch.steps]
    assert [s.step_s for s in per_request.steps] == pytest.approx([s.step_s for s in batch.steps])
    assert per_request.regret_tokens == pytest.approx(batch.regret_tokens)


def test_signals_asked_for_but_no_request_gammas_leave_the_run_unchanged() -> None:
    """Building per-request signals changes nothing: the old path stays bit-identical."""
    asks = Scripted(cap=2, even=None)
    with_signals, without = simulate(asks), simulate(Batch(2))
    assert with_signals.steps == without.steps
    assert with_signals.makespan_s == without.makespan_s
    assert any(ctx.requests for ctx in asks.contexts)


def test_a_batch_source_gets_no_request_signals() -> None:
    class Watch(Batch):
        contexts: ClassVar[list[StepContext]] = []

        def decide(self, ctx: StepContext, sim: Simulator) -> Decided:
            self.contexts.append(ctx)
            return super().decide(ctx, sim)

    watch = Watch(2)
    simulate(watch)
    assert watch.contexts and not any(ctx.requests for ctx in watch.contexts)
    assert not PolicySource.named("static", {"gamma": 2}).per_request


# -- the mixed population ----------------------------------------------------------------------


def test_the_mix_is_drawn_by_category_deterministically_per_seed() -> None:
    def alphas(seed: int) -> list[float]:
        sim = Simulator(PROFILE, MIX, SPECS, Batch(0), SimConfig(seed=seed))
        return [r.alpha for r in sim.requests]

    assert alphas(5) == alphas(5) and alphas(5) != alphas(6)
    rng = random.Random(1)
    draws = [MIX.sample_alpha(rng) for _ in range(6000)]
    means = [model.mean for _, model in MIX.parts]
    assert statistics.fmean(draws) == pytest.approx(statistics.fmean(means), abs=0.01)
    # Two categories: wider than one model with the same mean.
    single = AcceptanceModel("one", statistics.fmean(means))
    alone = [single.sample_alpha(rng) for _ in range(6000)]
    assert statistics.pstdev(draws) > 1.2 * statistics.pstdev(alone)


def test_mix_categories_reproduce_the_published_acceptance() -> None:
    code, writing = (model.mean for _, model in MIXES["code-writing"].parts)
    assert expected_tokens(code, 8) == pytest.approx(4.57)
    assert expected_tokens(writing, 8) == pytest.approx(2.64)
    python, translation = (model.mean for _, model in MIXES["code-translation"].parts)
    # accepted / drafted at n_max = 4: (E[tokens] − 1) / 4
    assert (expected_tokens(python, 4) - 1) / 4 == pytest.approx(0.81)
    assert (expected_tokens(translation, 4) - 1) / 4 == pytest.approx(0.41)


def test_mixed_workloads_replay_the_arrivals_of_their_homogeneous_one() -> None:
    homogeneous = workloads(DATA, 1, quick=True)
    mixed = mixed_workloads(homogeneous)
    bench = BenchConfig(DATA, [1], quick=True)
    for name, (base, mix) in MIXED.items():
        assert mixed[name] is homogeneous[base]
        assert acceptance_of(name, mixed[name], bench) is MIXES[mix]
        assert acceptance_of(base, homogeneous[base], bench) is WORKLOADS["chat-sps"]


# -- dsde end to end ---------------------------------------------------------------------------


class Recording(PolicySource):
    def __init__(self, source: PolicySource) -> None:
        super().__init__(source.policy)
        self.decided: list[tuple[StepContext, Decided]] = []

    def decide(self, ctx: StepContext, sim: Simulator) -> Decided:
        decided = super().decide(ctx, sim)
        self.decided.append((ctx, decided))
        return decided


def test_dsde_runs_end_to_end_with_per_request_gammas() -> None:
    source = Recording(PolicySource.named("dsde", {"gamma_max": 4}))
    assert source.per_request
    result = simulate(source)
    assert all(r.generated == r.spec.output_tokens for r in result.requests)
    state = source.policy.state()["engines"]["sim"]  # type: ignore[attr-defined]
    assert state["calibration"]["max_accepted"] > 0  # it saw per-request accepts
    assert state["requests"]  # and per-request histories
    answered = [(ctx, d) for ctx, d in source.decided if d.request_gammas]
    assert answered
    for ctx, decided in answered:
        assert {rid for rid, _ in decided.request_gammas} == {r.request_id for r in ctx.requests}
        assert all(0 <= g <= decided.gamma for _, g in decided.request_gammas)
    # Somewhere the batch ran with different γ per request.
    assert any(len({g for _, g in d.request_gammas}) > 1 for _, d in answered)


# -- the limit of per-request γ ----------------------------------------------------------------


class WatchedOracle(RequestOracleSource):
    """The per-request oracle, each step's plan set beside the best batch γ's goodput."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float, int]] = []

    def decide(self, ctx: StepContext, sim: Simulator) -> Decided:
        decided = super().decide(ctx, sim)
        top = ctx.max_gamma if ctx.draft_resident else 0
        plan = sim.best_request_plan(top)
        distinct = len({g for _, g in decided.request_gammas})
        self.steps.append((1000.0 * plan.goodput, max(sim.expected_goodputs(top)), distinct))
        return decided


def test_the_request_oracle_plans_no_worse_than_any_batch_gamma_and_beats_the_batch_oracle() -> (
    None
):
    """Its candidates include every batch γ (every request at the cap), so no step's plan
    is predicted below the best batch γ; on the mixed population it splits γ across the
    batch and gets more tokens per step time than the per-step batch oracle (regret < 0)."""
    source = WatchedOracle()
    result = simulate(source)
    assert all(r.generated == r.spec.output_tokens for r in result.requests)
    assert source.steps
    assert all(plan >= best * (1 - 1e-9) for plan, best, _ in source.steps)
    assert any(plan > best * 1.01 for plan, best, _ in source.steps)
    assert any(distinct > 1 for _, _, distinct in source.steps)
    assert result.regret_tokens < 0
