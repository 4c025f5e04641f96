"""Goodput-model policy: γ = argmax of a learned goodput model, explored by Thompson sampling.

Nightjar's Algorithm 1 (``nightjar.py``) treats every (batch size, γ) as an unrelated arm
and explores whole bins uniformly; at the batch sizes a busy engine runs, that is
minutes of random γ. This policy uses the structure of the problem instead
(``models.py``): one acceptance rate α per learner and one step-time regression
t(B, γ, context) pooled over every batch size, so each step informs every (B, γ). Each
decision:

1. while the learner has seen fewer than ``warmup_steps`` steps, γ comes from a prior
   batch-size table (vLLM's dynamic-SD shape by default), so the first seconds are no
   worse than the table;
2. a γ never run in this batch size's octave (where the estimate is an extrapolation
   from other batch sizes) is run once if it is the point estimate's best γ or next to
   it, within ``trial_loss_cap`` of its goodput: a local search up the unimodal goodput
   curve over γ;
3. otherwise it draws α̃ and the regression weights w̃ from their posteriors (Thompson
   sampling) and picks γ = argmax B·E(α̃, γ) / (t̃(B, γ) + switch(γ)), where switch is the
   profiled catch-up c_prefill(L_max, B) when speculation was off. The draw only moves γ
   where the posterior is still wide, never uniformly over all arms, and only to a γ whose
   point-estimate goodput is within ``explore_loss_cap`` of the best (an exploratory step
   costs at most that much by the model's own estimate). Where the engine has run decode
   steps of this batch-size octave and γ, t̃ includes the regression's mean residual there
   (``local_correction``, models.LocalCorrection);
4. with ``tpot_slo_ms`` > 0 (AdaSpec, arXiv:2503.05096) only γ whose predicted per-token
   latency t(B, γ)/E(α, γ) of a decode step meets the SLO are candidates; when none does,
   the lowest predicted latency wins.

Both models forget exponentially (``acceptance_window_steps``, ``time_window_steps``), so
the choice follows a change of the request mix or of the step-time curve.

One policy: its decision, its one-pass candidate sets, its learned state
and that state's JSON form share the engine and learner records; the models are in
models.py, the per-engine plumbing in engine_state.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

# Imported with the policy, not on first use: numpy loads numpy.random lazily, and the
# first engine's first decision would pay that import (tens of ms) on the decision loop.
from numpy.random import PCG64, BitGenerator, Generator

from nightjar_common.types import BinType, Choice, StepContext, StepOutcome
from policy_server.policies.base import (
    FILE_PATH,
    MalformedStateError,
    PolicyError,
    count_limit,
    feasible_gamma_max,
    load_prefill_cost,
    parse_params,
)
from policy_server.policies.engine_state import EngineCheckpoint, EngineStatePolicy, EngineStates
from policy_server.policies.fixed import TablePolicy
from policy_server.policies.fleet_stats import FleetShare, GoodputPooling
from policy_server.policies.models import (
    FEATURES,
    MAX_OCTAVE,
    AcceptanceModel,
    BatchRows,
    Fit,
    FloatArray,
    LocalCorrection,
    StepTimeModel,
    batch_octave,
    batch_rows,
    expected_tokens,
    predict_ms_many,
    step_features,
    verify_features,
)
from policy_server.policies.per_request import (
    Plan,
    PlanPricer,
    PlanRows,
    RequestRecord,
    batch_tokens,
    best_plan,
    observe_requests,
    plan_features,
    prune,
    records_from_json,
    records_to_json,
    shrunk_alpha,
    touch,
    trim_records,
)
from policy_server.policies.request_mode import ModeParams, Reason, RequestMode, sure_alphas
from policy_server.policies.rng import SplitMix64

# 2: the step-time statistics are weighted for relative error (models.StepTimeModel).
# 3: + the local correction's cells (a goodput/2 state loads with none).
# 4: + each engine's per-request acceptance records (a goodput/3 state loads with none).
STATE_SCHEMA = "goodput/4"
_READABLE_SCHEMAS = ("goodput/2", "goodput/3", STATE_SCHEMA)

# (batch octave, γ) trials an engine started (EngineState.trials).
Trials = frozenset[tuple[int, int]]
# A row's decision: its choice, the engine's trials after it, whether it drew (_choose).
Chosen = tuple[Choice, Trials, bool]
# Per batch size (row) and γ (column): whether a decision may pick it.
Mask = npt.NDArray[np.bool_]


@dataclasses.dataclass(frozen=True, slots=True)
class GoodputParams:
    gamma_max: int = 4
    seed: int = 0
    # Learn per StepContext.learner_key (model@device) when the engine sends one.
    share_learner: bool = True
    # Steps of a learner decided by the prior table before the model takes over.
    warmup_steps: int = 32
    # vLLM dynamic-SD shaped prior, [[start_bs, end_bs, gamma], ...] (see the table policy).
    prior_schedule: list[list[int]] = dataclasses.field(
        default_factory=lambda: [[1, 8, 3], [9, 24, 1], [25, 1 << 20, 0]]
    )
    # Prior α and its weight in pseudo-tokens (a weak prior: one step of a batch outweighs it).
    prior_alpha: float = 0.6
    prior_weight: float = 8.0
    # Effective memory (steps) of the acceptance counts and of the step-time regression.
    acceptance_window_steps: int = 64
    time_window_steps: int = 2048
    # Ridge ρ of the step-time regression (features are O(1); ms² per unit).
    ridge: float = 0.01
    # Add the regression's mean residual per (batch-size octave, γ) where decode steps ran,
    # shrunk by ``correction_prior_steps`` pseudo-steps, forgotten over
    # ``correction_window_steps`` steps of that cell: it learns the curve's shapes the
    # pooled features miss, at the price of noise in cells with few steps (docs/POLICIES.md,
    # "Where the engine runs, its own residuals").
    local_correction: bool = True
    correction_prior_steps: float = 2.0
    correction_window_steps: int = 256
    # A (batch-size octave, γ) cell never run takes the line in γ through the octave's
    # run cells' offsets (two or more) instead of none: the regression's slope in γ is
    # corrected where it is seen to be off (models.LocalCorrection._unrun_line).
    correction_unrun_line: bool = False
    # A Thompson draw may move γ off the point estimate's best only to a γ predicted to lose
    # at most this fraction of its goodput (1 = plain Thompson sampling): smaller wastes
    # fewer steps on γ the model already ranks behind, larger lets the draws correct a wrong
    # ranking sooner (docs/POLICIES.md, "Decision").
    explore_loss_cap: float = 0.02
    # A γ never run in a batch size's octave is run once there when it is the best γ or
    # next to it and its point-estimate goodput is within this fraction of the best's, or
    # within the octave's measured misfit (what the regression is off by on the decode
    # steps run there) where that is larger; 0 = no trials. There the estimate is an
    # extrapolation, and a γ it puts less far behind than it is known to be wrong may
    # well be the best. Larger finds more of the γ an extrapolation mispriced and pays for
    # more trial steps that lose (docs/POLICIES.md, "Trials").
    trial_loss_cap: float = 0.2
    # 0 = maximise goodput; > 0: only γ whose predicted TPOT (ms) meets it.
    tpot_slo_ms: float = 0.0
    # CSV of c_prefill(L_max, B) (policy_server/prefill_cost.py); "" = no switching cost.
    prefill_cost_table: str = dataclasses.field(default="", metadata=FILE_PATH)
    # Per-sequence mode (per_request.py): a γ per request from its own acceptance, shrunk
    # to the pooled α by ``request_prior_weight`` pseudo-tokens while it is young; the
    # engine then sends per-request signals. Requests not in a step for
    # ``request_idle_steps`` of the engine's steps are forgotten. "auto": each engine
    # plans per request only while the plans are predicted to beat the batch γ by a
    # margin the model is sure of (request_mode.py); true / false force it.
    per_request: bool | str = "auto"
    request_prior_weight: float = 12.0
    request_idle_steps: int = 64
    # "auto": an engine plans per request once its plans' predicted gain over the batch γ
    # (a fraction of goodput, each request's α pulled ``request_sure_z`` standard errors
    # towards the pooled α) is surely above ``request_gain_on``, and stops once it is
    # surely below ``request_gain_off``; checked every ``request_check_steps`` steps, the
    # last ``request_gain_window`` checks averaged (docs/POLICIES.md, "Per-request mode").
    request_gain_on: float = 0.0015
    request_gain_off: float = 0.0005
    request_sure_z: float = 1.0
    request_check_steps: int = 16
    request_gain_window: int = 64

    def __post_init__(self) -> None:
        if not 1 <= self.gamma_max <= 64:
            raise PolicyError(f"gamma_max must be in 1..64, got {self.gamma_max}")
        if not 0 <= self.warmup_steps <= 1_000_000:
            raise PolicyError("warmup_steps must be in 0..1000000")
        if not 0.0 < self.prior_alpha < 1.0:
            raise PolicyError("prior_alpha must be in (0, 1)")
        if not 0.0 < self.prior_weight <= 1e6:
            raise PolicyError("prior_weight must be in (0, 1e6]")
        for name in ("acceptance_window_steps", "time_window_steps", "correction_window_steps"):
            if not 1 <= getattr(self, name) <= 10_000_000:
                raise PolicyError(f"{name} must be in 1..10000000")
        if not 0.0 < self.ridge <= 1e6:
            raise PolicyError("ridge must be in (0, 1e6]")
        if not 0.0 < self.correction_prior_steps <= 1e6:
            raise PolicyError("correction_prior_steps must be in (0, 1e6]")
        for name in ("explore_loss_cap", "trial_loss_cap"):
            if not (math.isfinite(getattr(self, name)) and 0.0 <= getattr(self, name) <= 1.0):
                raise PolicyError(f"{name} must be in 0..1")
        if not (math.isfinite(self.tpot_slo_ms) and 0.0 <= self.tpot_slo_ms <= 1e6):
            raise PolicyError("tpot_slo_ms must be in 0..1e6 (0 = off)")
        if not 0.0 < self.request_prior_weight <= 1e6:
            raise PolicyError("request_prior_weight must be in (0, 1e6]")
        if not 1 <= self.request_idle_steps <= 1_000_000:
            raise PolicyError("request_idle_steps must be in 1..1000000")
        if self.per_request is True and self.tpot_slo_ms > 0:
            # The SLO filter is per batch γ; a per-request plan would need one per request.
            raise PolicyError("per_request does not combine with tpot_slo_ms")
        if isinstance(self.per_request, str) and self.per_request != "auto":
            raise PolicyError(
                f'per_request must be true, false or "auto", got {self.per_request!r}'
            )
        if not 0.0 <= self.request_gain_off <= self.request_gain_on <= 1.0:
            raise PolicyError("request_gain_off and request_gain_on need 0 <= off <= on <= 1")
        if not 0.0 <= self.request_sure_z <= 10.0:
            raise PolicyError("request_sure_z must be in 0..10")
        for name in ("request_check_steps", "request_gain_window"):
            if not 1 <= getattr(self, name) <= 1_000_000:
                raise PolicyError(f"{name} must be in 1..1000000")


@dataclasses.dataclass(slots=True)
class Learner:
    """What engines of one learner key share: the two models and a few running figures."""

    acceptance: AcceptanceModel
    step_time: StepTimeModel
    correction: LocalCorrection
    steps: int = 0
    # Forgotten means of prefill tokens per step and of context tokens per request (for
    # people and the summary in the state; decisions price decode steps).
    prefill_tokens: float = 0.0
    context_per_request: float = 0.0
    # StepContext.min_draft_passes of the latest step (for the summary in the state).
    min_draft_passes: int = 0
    # What of the models is the fleet's evidence (fleet_stats.py; None: never merged).
    fleet: FleetShare | None = None


@dataclasses.dataclass(slots=True)
class EngineState:
    # Per-engine stream (PCG64): decisions reproducible whatever the interleaving.
    rng: Generator
    learner_id: str
    previous_gamma: int | None = None
    # (batch octave, γ) trials this engine started: not started again while the outcome
    # that makes the cell "run" is on its way (a step or two in vLLM).
    # Immutable, so that a checkpoint holds it without a copy.
    trials: Trials = frozenset()
    # Per-sequence mode: acceptance records of recent requests by id, and the outcomes
    # observed (what a record's last_seen counts). Only observe() changes them.
    requests: dict[str, RequestRecord] = dataclasses.field(default_factory=dict)
    observed_steps: int = 0
    # Whether the engine plans per request, and why (request_mode.py); set by observe().
    mode: RequestMode = dataclasses.field(default_factory=RequestMode)

    @property
    def stream(self) -> BitGenerator:
        return self.rng.bit_generator


@dataclasses.dataclass(frozen=True, slots=True)
class Prediction:
    """Per γ: expected tokens per request and step milliseconds, point or sampled."""

    tokens: list[float]
    step_ms: FloatArray


@dataclasses.dataclass(slots=True)
class Estimate:
    """The model of one decision, point or drawn, for any batch size of its step: expected
    tokens per request per γ (independent of the batch size) and the step-time weights,
    with the local correction's offsets cached per batch-size octave (all they depend on
    of the batch size), so the candidates of a set share everything but the product."""

    tokens: list[float]
    top: int
    learner: Learner
    weights: FloatArray
    context_tokens: int
    min_draft_passes: int
    # The correction's standard normals for a drawn estimate, None for the point one.
    normals: FloatArray | None
    correct: bool
    # Predictions below this are extrapolation noise: a tenth of the mean step time.
    floor_ms: float
    # The pooled α the tokens are of (per-request α are shrunk to it).
    alpha: float
    offsets: dict[int, FloatArray] = dataclasses.field(default_factory=dict)
    # GoodputParams.correction_unrun_line.
    unrun_line: bool = False
    # The context's own batch size and, per γ, its requests' expected tokens per request
    # from their own α (shrunk to ``alpha``), where the engine has records of them: that
    # size prices those, every other size the pooled ``tokens`` (``_own_tokens``).
    own: tuple[int, list[float]] | None = None

    def row_tokens(self, rows: BatchRows) -> FloatArray:
        """Expected tokens per request, a row per batch size and a column per γ."""
        tokens = np.tile(np.asarray(self.tokens), (len(rows.sizes), 1))
        if self.own is not None and self.own[0] in rows.sizes:
            tokens[rows.sizes.index(self.own[0])] = self.own[1]
        return tokens

    def priced(self, rows: BatchRows, switch_ms: FloatArray) -> tuple[FloatArray, FloatArray]:
        """Per batch size (a row each) and γ (a column each): the predicted decode-step ms
        and the goodput, tokens per request per ms with the switch cost (the batch size is
        a common factor of a row). Element by element what one size alone gives (IEEE
        arithmetic; predict_ms_many's rows are independent), so a decision does not depend
        on how many sizes were asked with it."""
        ms = self.predict_many(rows)
        goodput: FloatArray = self.row_tokens(rows) / (np.maximum(ms, self.floor_ms) + switch_ms)
        return ms, goodput

    def predict(self, batch_size: int) -> Prediction:
        """Decode-step ms for γ = 0..top at ``batch_size``, with the local correction."""
        rows = batch_rows((batch_size,))
        return Prediction(self.row_tokens(rows)[0].tolist(), self.predict_many(rows)[0])

    def predict_many(self, rows: BatchRows) -> FloatArray:
        """Decode-step ms, one row of γ = 0..top per batch size, with the correction."""
        ms = predict_ms_many(
            self.weights,
            rows.sizes,
            self.top,
            context_tokens=self.context_tokens,
            min_draft_passes=self.min_draft_passes,
        )
        if self.correct:
            offsets = [self._offsets(b) for b in rows.firsts]  # one row per octave
            for position, run in rows.runs:  # broadcast down the octave's rows
                ms[run] += offsets[position]
        return ms

    def plan_pricer(self, batch_size: int, switch_ms: FloatArray) -> PlanPricer:
        """Step ms of per-request plans at ``batch_size`` (per_request.PlanPricer): the
        regression on the plan's verify work, the correction of its cap's cell, floored
        as ``priced`` floors, plus the switch cost of the cap (``switch_ms``, per γ)."""

        def price(rows: PlanRows, attention: FloatArray) -> FloatArray:
            x = plan_features(rows, self.min_draft_passes, attention, self.context_tokens)
            ms: FloatArray = x @ self.weights
            if self.correct:
                ms = ms + self._offsets(batch_size)[rows.caps]
            priced: FloatArray = np.maximum(ms, self.floor_ms) + switch_ms[rows.caps]
            return priced

        return price

    def _offsets(self, batch_size: int) -> FloatArray:
        octave = batch_octave(batch_size)
        offsets = self.offsets.get(octave)
        if offsets is None:
            drawn = self.normals is not None  # the point estimate's offsets need no σ²
            noise = self.learner.step_time.noise_variance if drawn else 0.0
            offsets = self.learner.correction.offsets_ms(
                self.weights, batch_size, self.top, noise, self.normals, self.unrun_line
            )
            self.offsets[octave] = offsets
        return offsets


class GoodputModelPolicy(GoodputPooling, EngineStatePolicy[GoodputParams, EngineState, Learner]):
    name: ClassVar[str] = "goodput"
    state_schema: ClassVar[str] = STATE_SCHEMA

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        self._params = parse_params(GoodputParams, params, self.name)
        p = self._params
        self._prior = TablePolicy({"schedule": p.prior_schedule, "default_gamma": 0})
        self._prefill_cost = load_prefill_cost(p.prefill_cost_table, self.name)
        self._acceptance_decay = 1.0 - 1.0 / p.acceptance_window_steps
        self._time_decay = 1.0 - 1.0 / p.time_window_steps
        self._correction_decay = 1.0 - 1.0 / p.correction_window_steps
        self._book: EngineStates[EngineState, Learner] = EngineStates(
            p.seed, p.share_learner, _new_engine, self._new_learner
        )
        self._mode_params = ModeParams(
            p.request_gain_on,
            p.request_gain_off,
            p.request_gain_window,
            # Enough checks that the bounds rest on more than a lucky few.
            min(16, p.request_gain_window),
            p.request_sure_z,
        )

    @property
    def reads_request_signals(self) -> bool:
        """Engines send per-request signals (base.reads_request_signals) unless the
        per-sequence mode is forced off: "auto" learns from them whether to plan."""
        return self._params.per_request is not False

    @property
    def _auto(self) -> bool:
        return self._params.per_request == "auto"

    # -- Policy protocol -------------------------------------------------------------

    def decide(self, ctx: StepContext) -> Choice:
        engine, top = self._engine_and_top(ctx)
        rows = batch_rows((ctx.batch_size,))
        choice, engine.trials, _ = self._choose(engine, top, ctx, rows)[0][0]
        engine.previous_gamma = choice.gamma
        return choice

    def decide_candidates(
        self, ctx: StepContext, batch_sizes: Sequence[int]
    ) -> list[tuple[Choice, object]]:
        """CheckpointedDecide's loop in one pass (the same choices and checkpoints,
        tests/policy_server/policies/test_goodput_candidates.py). The loop restores the RNG
        before each candidate, so all of them decide on the same posterior draw: the whole
        set is priced as one matrix (a row per batch size) under the point estimate and
        under that one draw, and each checkpoint is built directly instead of copied. An
        exploring candidate's checkpoint holds the greedy choice of its batch size with
        that choice's own checkpoint (``exploit``)."""
        before = self.checkpoint(ctx)
        engine, top = self._engine_and_top(ctx)
        # The RNG as the checkpoint holds it (read once: a PCG64 state read builds a dict).
        if isinstance(before, EngineCheckpoint):
            unchanged = before.rng_state
        else:  # the engine's first decision
            unchanged = engine.stream.state
        chosen, exploits = self._choose(engine, top, ctx, batch_rows(tuple(batch_sizes)))
        drawn = engine.stream.state  # advanced by the draw if any candidate drew
        self.restore(ctx, before)
        # Candidates that chose alike share their checkpoint (all of a table, nearly).
        checkpoints: dict[tuple[Any, ...], EngineCheckpoint[EngineState, Trials]] = {}

        def checkpoint(
            choice: Choice, trials: Trials, drew: bool, exploit: tuple[Choice, object] | None
        ) -> EngineCheckpoint[EngineState, Trials]:
            key = (choice.gamma, drew, trials, exploit and exploit[0].gamma)
            after = checkpoints.get(key)
            if after is None:
                rng = drawn if drew else unchanged
                after = checkpoints[key] = EngineCheckpoint(
                    engine, rng, choice.gamma, trials, exploit
                )
            return after

        decided: list[tuple[Choice, object]] = []
        for row, (choice, trials, drew) in enumerate(chosen):
            exploit: tuple[Choice, object] | None = None
            if row in exploits:  # a drawn row: the draw was made, the trials unchanged
                greedy = _choice(exploits[row], BinType.EXPLOIT)
                exploit = (greedy, checkpoint(greedy, trials, True, None))
            decided.append((choice, checkpoint(choice, trials, drew, exploit)))
        return decided

    def exploit(self, decided: object) -> tuple[Choice, object] | None:
        return decided.exploit if isinstance(decided, EngineCheckpoint) else None

    def observe(self, ctx: StepContext, choice: Choice, outcome: StepOutcome) -> None:
        engine = self._book.engine(ctx)
        learner = self._book.learner(engine.learner_id)
        # A per-request plan's γ_i by request id, read by both below (a batch γ's step,
        # nearly every one, builds no dict).
        planned: Mapping[str, int] = dict(choice.request_gammas) if choice.request_gammas else {}
        verified = self._observe_requests(engine, ctx, planned, outcome)
        learner.acceptance.observe(
            outcome.gamma,
            outcome.drafted_tokens,
            outcome.accepted_tokens,
            outcome.request_accepts,
            verified,
        )
        x = self._step_features(ctx, choice, planned, outcome)
        milliseconds = 1000.0 * outcome.step_seconds
        learner.step_time.observe(x, milliseconds)
        # Kept while the correction is off too (a few adds into a bounded block per batch
        # octave), so that turning it on with `swap --keep-state` starts informed.
        if outcome.prefill_tokens == 0:  # decisions are priced as decode steps
            learner.correction.observe(ctx.batch_size, outcome.gamma, x, milliseconds)
        learner.steps += 1
        rate = 1.0 - self._acceptance_decay
        learner.prefill_tokens += rate * (outcome.prefill_tokens - learner.prefill_tokens)
        per_request = ctx.context_tokens / ctx.batch_size
        learner.context_per_request += rate * (per_request - learner.context_per_request)
        # Within Γmax, as state loading checks (the engine's max_gamma may exceed it).
        learner.min_draft_passes = min(ctx.min_draft_passes, self._params.gamma_max)
        if engine.previous_gamma == choice.gamma:
            engine.previous_gamma = outcome.gamma
        if self._auto:
            self._check_mode(engine, learner, ctx)

    def _check_mode(self, engine: EngineState, learner: Learner, ctx: StepContext) -> None:
        """ "auto": every ``request_check_steps`` observed steps of a batch its context
        names whole, price the best per-request plan against the best batch γ for its
        requests and let the gain move the engine's mode (request_mode.py)."""
        mode, p = engine.mode, self._params
        if ctx.runtime is not None and not ctx.runtime.request_gammas_applied:
            mode.engaged, mode.reason = False, Reason.ENGINE_CANNOT_APPLY
            return
        if p.tpot_slo_ms > 0:
            mode.engaged, mode.reason = False, Reason.TPOT_SLO
            return
        if engine.observed_steps % p.request_check_steps or learner.steps < p.warmup_steps:
            return
        top = feasible_gamma_max(ctx, p.gamma_max)
        if top == 0 or len(ctx.requests) != ctx.batch_size or ctx.batch_size < 2:
            return  # nothing to plan: one γ, or requests the context does not name
        plan = self._sure_plan(engine, learner, ctx, top)
        mode.check(plan.goodput / plan.batch_goodput - 1.0, self._mode_params)

    def _sure_plan(self, engine: EngineState, learner: Learner, ctx: StepContext, top: int) -> Plan:
        """The best plan for ``ctx``'s requests under the point estimate, each request's α
        only as far from the pooled α as its counts make sure of (request_mode.sure_alphas),
        with the best batch γ's goodput under the same α beside it."""
        point = self._estimate(learner, ctx, top)
        records = [engine.requests.get(r.request_id) for r in ctx.requests]
        p = self._params
        alphas = sure_alphas(records, point.alpha, p.request_prior_weight, p.request_sure_z)
        contexts = [r.context_tokens for r in ctx.requests]
        pricer = point.plan_pricer(ctx.batch_size, np.zeros(top + 1))
        return best_plan(alphas, contexts, top, pricer)

    def _observe_requests(
        self,
        engine: EngineState,
        ctx: StepContext,
        planned: Mapping[str, int],
        outcome: StepOutcome,
    ) -> tuple[int, ...]:
        """Per-sequence mode: add the step's labelled accepts to the requests' records and
        forget idle requests; the γ each accept verified (() when off or unlabelled: the
        pooled model then takes every request at the step's γ)."""
        if self._params.per_request is False:
            return ()
        engine.observed_steps += 1
        step = engine.observed_steps
        labelled = len(outcome.request_ids) == len(outcome.request_accepts)
        # Accepts without ids (an engine that does not name requests) teach no record.
        ids = outcome.request_ids if labelled else ()
        accepts = outcome.request_accepts if labelled else ()
        cap = outcome.gamma
        if planned:
            verified = tuple(min(planned.get(rid, cap), cap) for rid in ids)
        else:  # every request verified the step's γ
            verified = (cap,) * len(ids)
        records = engine.requests
        observe_requests(
            records,
            zip(ids, accepts, verified, strict=True),
            self._acceptance_decay,
            step,
        )
        # After the outcome: the requests it labelled are seen already, not moved twice;
        # an outcome that labels the context's requests (nearly every one) leaves none.
        names = tuple(r.request_id for r in ctx.requests)
        if names != ids:
            touch(records, names, step)
        prune(records, step, self._params.request_idle_steps)
        return verified

    def _step_features(
        self,
        ctx: StepContext,
        choice: Choice,
        planned: Mapping[str, int],
        outcome: StepOutcome,
    ) -> FloatArray:
        """The regression row of the step: the batch one, or, where the requests verified
        their own γ_i (``planned``: a per-request plan that ran), the row of that verify
        work."""
        if not planned or outcome.gamma != choice.gamma:
            return step_features(
                ctx.batch_size,
                outcome.gamma,
                outcome.prefill_tokens,
                ctx.context_tokens,
                outcome.drafted_gamma,
                ctx.min_draft_passes,
            )
        gammas = [planned.get(r.request_id, choice.gamma) for r in ctx.requests]
        # Requests the context did not name verified the cap (the engine's default).
        verified = sum(gammas) + choice.gamma * max(0, ctx.batch_size - len(gammas))
        contexts = [r.context_tokens for r in ctx.requests]
        total = sum(contexts)
        weighted = sum(c * g for c, g in zip(contexts, gammas, strict=True))
        attention = weighted / total if total else verified / ctx.batch_size
        passes = max(outcome.drafted_gamma, ctx.min_draft_passes)
        rows = verify_features(
            ctx.batch_size,
            np.array([float(passes)]),
            np.array([float(verified)]),
            np.array([attention]),
            ctx.context_tokens,
            outcome.prefill_tokens,
        )
        row: FloatArray = rows[0]
        return row

    # -- LearnedState protocol (with EngineStatePolicy) ----------------------------------

    def _checkpoint_part(self, ctx: StepContext, engine: EngineState) -> Any:
        return engine.trials  # decide() may start a trial (immutable: held as it is)

    def _restore_part(self, engine: EngineState, part: Any) -> None:
        engine.trials = part

    def state(self, engine_id: str | None = None) -> dict[str, Any]:
        engines, learners = self._book.selected(engine_id)
        return {
            "schema": STATE_SCHEMA,
            "gamma_max": self._params.gamma_max,
            "engines": {
                eid: {
                    "learner": e.learner_id,
                    "previous_gamma": e.previous_gamma,
                    "trials": sorted([octave, gamma] for octave, gamma in e.trials),
                    "rng": e.rng.bit_generator.state,
                    "requests": records_to_json(e.requests),
                    "observed_steps": e.observed_steps,
                    "request_mode": self._mode_json(e),
                }
                for eid, e in engines.items()
            },
            "learners": {lid: self._learner_to_json(v) for lid, v in learners.items()},
        }

    def _mode_json(self, engine: EngineState) -> dict[str, Any]:
        """The engine's per-request mode as the state shows it: "per-request" or "batch",
        why (request_mode.Reason), and under "auto" what decides it (read back by
        load_state; "mode" and "gain_mean" are for people)."""
        per_request = self._params.per_request
        if per_request is True or per_request is False:
            forced = Reason.FORCED_ON if per_request else Reason.FORCED_OFF
            return {"mode": "per-request" if per_request else "batch", "reason": forced.value}
        mode = engine.mode
        low, high = mode.gains.bounds(self._params.request_sure_z)
        return {
            "mode": "per-request" if mode.engaged else "batch",
            "gain_mean": mode.gains.mean,
            "gain_bounds": [low, high] if math.isfinite(low) else None,
            **mode.to_json(),
        }

    def request_modes(self) -> dict[str, tuple[str, str]]:
        """Engine id → (mode, reason) of every engine, for the server's metric (read from
        the scrape's thread: the engines are copied in one call, which the GIL keeps whole
        while a decision adds one)."""
        out: dict[str, tuple[str, str]] = {}
        for engine_id, engine in list(self._book.engines.items()):
            view = self._mode_json(engine)
            out[engine_id] = (view["mode"], view["reason"])
        return out

    def request_records(self) -> int:
        """Per-request records held, of all engines (the server's bytes gauge)."""
        return sum(len(engine.requests) for engine in list(self._book.engines.values()))

    @staticmethod
    def trim_state(state: dict[str, Any], excess_bytes: int) -> str:
        """Lose what a snapshot can (base.trim_state): per-request records, least recently
        seen first; what was dropped, "" for nothing."""
        dropped = trim_records(state.get("engines", {}), excess_bytes)
        return f"{dropped:,} per-request records, least recently seen first" if dropped else ""

    def load_state(self, state: Mapping[str, Any]) -> None:
        if state.get("schema") not in _READABLE_SCHEMAS:
            raise PolicyError(
                f"state schema {state.get('schema')!r} is not one of {_READABLE_SCHEMAS}"
            )
        self._check_gamma_max(state)
        try:
            engines = {
                str(eid): self._engine_from_json(e) for eid, e in dict(state["engines"]).items()
            }
            learners = {
                str(lid): self._learner_from_json(data)
                for lid, data in dict(state["learners"]).items()
            }
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise MalformedStateError(f"malformed goodput state: {exc!r}") from exc
        self._book.engines, self._book.learners = engines, learners

    # -- what operators and tests look at ------------------------------------------------

    def predicted_goodput(self, learner_id: str, ctx: StepContext) -> list[float]:
        """Point-estimate goodput (tokens/s) per γ for a step like ``ctx`` (0..Γmax)."""
        learner = self._book.learners[learner_id]
        point = self._point(learner, ctx, self._params.gamma_max)
        return [
            1000.0 * ctx.batch_size * point.tokens[g] / max(float(point.step_ms[g]), 1e-9)
            for g in range(len(point.tokens))
        ]

    def predicted_tpot_ms(self, learner_id: str, ctx: StepContext) -> list[float]:
        """Point-estimate ms per token of one request per γ (what the SLO is checked on)."""
        learner = self._book.learners[learner_id]
        return _tpot_ms(self._point(learner, ctx, self._params.gamma_max))

    def predicted_step_ms(self, learner_id: str, ctx: StepContext, outcome: StepOutcome) -> float:
        """What the learner expected of a step as it ran (its γ, drafts, prefill and
        context), to set beside the measured time: the step-time regression, plus for a
        decode step the local correction of its batch-size octave and γ, as a decision
        prices it."""
        learner = self._book.learners[learner_id]
        weights = learner.step_time.fit().weights
        x = self._step_features(ctx, _choice(outcome.gamma, BinType.EXPLOIT), {}, outcome)
        ms = float(x @ weights)
        if self._params.local_correction and not outcome.prefill_tokens:
            top = self._params.gamma_max
            offsets = learner.correction.offsets_ms(weights, ctx.batch_size, top, 0.0, None)
            ms += float(offsets[min(outcome.gamma, top)])
        return ms

    def point_prediction(self, learner_id: str, ctx: StepContext) -> Prediction:
        """What the point estimate expects of a decode step of ``ctx`` at each γ the
        engine may run: tokens per request and step ms, local correction included — the
        two factors a decision ranks by, to set beside the cells a run measured."""
        learner = self._book.learners[learner_id]
        top = feasible_gamma_max(ctx, self._params.gamma_max)
        return self._estimate(learner, ctx, top).predict(ctx.batch_size)

    def learner_of(self, engine_id: str) -> str:
        return self._book.engines[engine_id].learner_id

    # -- internals ----------------------------------------------------------------------

    def _new_learner(self) -> Learner:
        p = self._params
        return Learner(
            AcceptanceModel.with_prior(p.prior_alpha, p.prior_weight, self._acceptance_decay),
            StepTimeModel(self._time_decay, p.ridge),
            LocalCorrection(self._correction_decay, p.correction_prior_steps, p.gamma_max),
        )

    def _choose(
        self, engine: EngineState, top: int, ctx: StepContext, rows: BatchRows
    ) -> tuple[list[Chosen], dict[int, int]]:
        """What deciding ``ctx`` at each batch size would do to ``engine`` as it is: the
        choice, the engine's trials after it, and whether it drew from the RNG; and per
        row whose draw explores (not a trial), the greedy γ it would exploit instead.
        Changes nothing of the engine but its RNG, by the one draw every size that draws
        shares."""
        trials = engine.trials
        if top == 0:
            return [(_choice(0, BinType.FORCED), trials, False)] * len(rows.sizes), {}
        learner = self._book.learner(engine.learner_id)
        if learner.steps < self._params.warmup_steps:
            return [(self._prior_choice(b, top), trials, False) for b in rows.sizes], {}
        switch = self._switch_ms(ctx, engine, top, rows.sizes)
        point = self._estimate(learner, ctx, top, engine=engine)
        ms, goodput = point.priced(rows, switch)
        allowed = self._allowed(ms, point.row_tokens(rows))
        greedy = _best(goodput, allowed)
        greedy_gammas = greedy.tolist()
        tried = self._trials(learner, engine, rows, goodput, allowed, greedy_gammas)
        chosen: list[Chosen] = []
        drew = len(tried) < len(rows.sizes)
        if drew:
            # The table's one draw: the RNG advances by it alike whether or not it is used;
            # the drawn model is built only where it can change a choice.
            normals = self._draw(engine, top)
            sample: Estimate | None = None
            # Why the cap: with a 14-feature posterior and the few hundred steps a busy
            # engine runs at one batch size, plain Thompson draws keep trying γ far behind
            # the best (docs/POLICIES.md, "Decision"). Near-ties, where a wrong point
            # estimate is plausible and cheap, are still explored; a γ the estimate is only
            # extrapolated for was tried before any draw.
            keep = 1.0 - self._params.explore_loss_cap
            if _contested(goodput, allowed, keep):
                # Elsewhere the cap takes any drawn γ back to the greedy one: the draw is
                # priced only when it can change a choice.
                sample = self._sample(learner, ctx, top, normals, engine)
                _, drawn = sample.priced(rows, switch)
                sampled = _best(drawn, allowed).tolist()
                for gamma, best, values in zip(
                    sampled, greedy_gammas, goodput.tolist(), strict=True
                ):
                    if values[gamma] < keep * values[best]:
                        gamma = best
                    kind = BinType.EXPLOIT if gamma == best else BinType.EXPLORE
                    chosen.append((_choice(gamma, kind), trials, True))
            else:  # every row exploits its greedy γ
                exploit = {
                    g: (_choice(g, BinType.EXPLOIT), trials, True) for g in set(greedy_gammas)
                }
                chosen = [exploit[g] for g in greedy_gammas]
            for row, gamma in tried.items():
                chosen[row] = self._trial_choice(trials, rows.octaves[row], gamma)
            planned = self._request_row(engine, ctx, rows, tried)
            if planned is not None and chosen[planned][0].bin_type is BinType.EXPLOIT:
                plan = self._plan_choice(engine, ctx, point, switch[planned], top)
                chosen[planned] = (plan, trials, True)
        else:
            octaves = rows.octaves
            chosen = [self._trial_choice(trials, octaves[row], g) for row, g in tried.items()]
        # A drawn γ's steps after the first exploit; a trial's none: its outcome re-prices
        # the octave it pinned, which the next table should act on at once.
        exploits = {
            row: greedy_gammas[row]
            for row, (choice, _, _) in enumerate(chosen)
            if choice.bin_type is BinType.EXPLORE and row not in tried
        }
        return chosen, exploits

    def _request_row(
        self, engine: EngineState, ctx: StepContext, rows: BatchRows, tried: Mapping[int, int]
    ) -> int | None:
        """Per-sequence mode (forced, or engaged on this engine by "auto"): the row a
        per-request plan decides, the one of the batch size the context's requests make up
        (all of them named), unless it runs a trial (a trial pins the step-time fit at a
        batch γ)."""
        if not (ctx.requests and self._plans(engine, ctx)):
            return None
        size = len(ctx.requests)
        if size != ctx.batch_size or size not in rows.sizes:
            return None
        row = rows.sizes.index(size)
        return None if row in tried else row

    def _plans(self, engine: EngineState, ctx: StepContext) -> bool:
        """Whether ``engine`` plans per request for ``ctx``: forced on, or "auto" with the
        mode engaged on an engine that applies per-request γ."""
        per_request = self._params.per_request
        if per_request is True:
            return True
        if per_request is False or not engine.mode.engaged:
            return False
        return ctx.runtime is None or ctx.runtime.request_gammas_applied

    def _plan_choice(
        self,
        engine: EngineState,
        ctx: StepContext,
        point: Estimate,
        switch_ms: FloatArray,
        top: int,
    ) -> Choice:
        """The per-request plan for ``ctx``'s requests under the point estimate, for a row
        whose batch γ exploits: the plan refines the greedy γ request by request, while
        exploration stays the batch's (a drawn γ runs as a batch γ), so a decision
        searches one plan."""
        contexts = [r.context_tokens for r in ctx.requests]
        alphas = self._request_alphas(engine, ctx, point.alpha)
        plan = best_plan(alphas, contexts, top, point.plan_pricer(len(contexts), switch_ms))
        if plan.uniform:
            return _choice(plan.cap, BinType.EXPLOIT)
        ids = [r.request_id for r in ctx.requests]
        gammas = tuple(zip(ids, plan.gammas, strict=True))
        return Choice(plan.cap, BinType.EXPLOIT, request_gammas=gammas)

    def _request_alphas(self, engine: EngineState, ctx: StepContext, pooled: float) -> list[float]:
        """Each request's α: its own counts shrunk to ``pooled`` (the pooled α itself for a
        request never observed)."""
        records, weight = engine.requests, self._params.request_prior_weight
        return [shrunk_alpha(records.get(r.request_id), pooled, weight) for r in ctx.requests]

    def _trial_choice(self, trials: Trials, octave: int, gamma: int) -> tuple[Choice, Trials, bool]:
        """A trial of ``gamma`` in batch-size ``octave``: run, not started again meanwhile."""
        started = trials | {(octave, gamma)}
        return _choice(gamma, BinType.EXPLORE), started, False

    def _prior_choice(self, batch_size: int, top: int) -> Choice:
        """The warm-up's choice: the prior table's γ."""
        return _choice(min(self._prior.gamma_for(batch_size), top), BinType.EXPLOIT)

    def _switch_ms(
        self, ctx: StepContext, engine: EngineState, top: int, batch_sizes: Sequence[int]
    ) -> FloatArray:
        """Catch-up milliseconds each γ (column) pays this step at each batch size (row):
        only when speculation was off."""
        switch = np.zeros((len(batch_sizes), top + 1))
        if engine.previous_gamma == 0 and self._prefill_cost is not None:
            lag = ctx.max_draft_lag_tokens
            seconds = [self._prefill_cost.seconds_at(lag, b) for b in batch_sizes]
            switch[:, 1:] = 1000.0 * np.array(seconds)[:, None]
        return switch

    def _point(
        self, learner: Learner, ctx: StepContext, top: int, fit: Fit | None = None
    ) -> Prediction:
        return self._estimate(learner, ctx, top, fit).predict(ctx.batch_size)

    def _estimate(
        self,
        learner: Learner,
        ctx: StepContext,
        top: int,
        fit: Fit | None = None,
        engine: EngineState | None = None,
    ) -> Estimate:
        """The point estimate for ``ctx``'s step, under ``fit`` or the fit in use; with
        ``engine``, its size priced with its requests' own α (``_own_tokens``)."""
        weights = (fit or learner.step_time.fit()).weights
        return self._model(learner, learner.acceptance.alpha, weights, ctx, top, None, engine)

    def _draw(self, engine: EngineState, top: int) -> FloatArray:
        """The standard normals of one posterior draw, from the engine's RNG."""
        # The correction's draws only when it is on: off, the stream is as before it.
        extra = top + 1 if self._params.local_correction else 0
        normals: FloatArray = engine.rng.standard_normal(1 + FEATURES + extra)
        return normals

    def _sample(
        self,
        learner: Learner,
        ctx: StepContext,
        top: int,
        normals: FloatArray,
        engine: EngineState | None = None,
    ) -> Estimate:
        """The posterior's draw (α, the weights, the correction) given by ``normals``; the
        requests' own α are shrunk to the drawn α."""
        alpha = learner.acceptance.sample(float(normals[0]))
        weights = learner.step_time.fit().sample(normals[1 : 1 + FEATURES])
        return self._model(learner, alpha, weights, ctx, top, normals[1 + FEATURES :], engine)

    def _model(
        self,
        learner: Learner,
        alpha: float,
        weights: FloatArray,
        ctx: StepContext,
        top: int,
        normals: FloatArray | None,
        engine: EngineState | None = None,
    ) -> Estimate:
        own = None if engine is None else self._own_tokens(engine, ctx, alpha, top)
        return Estimate(
            [expected_tokens(alpha, g) for g in range(top + 1)],
            top,
            learner,
            weights,
            ctx.context_tokens,
            min(ctx.min_draft_passes, top),
            normals,
            self._params.local_correction,
            0.1 * max(learner.step_time.mean_ms, 1e-6),
            alpha,
            unrun_line=self._params.correction_unrun_line,
            own=own,
        )

    def _own_tokens(
        self, engine: EngineState, ctx: StepContext, alpha: float, top: int
    ) -> tuple[int, list[float]] | None:
        """``ctx``'s batch size with its requests' expected tokens per request per γ, from
        each request's own α (its records shrunk to ``alpha``), where the context names the
        whole batch and the engine has a record of one of them; else None (the pooled α
        prices it). Why: a small batch is a few requests, and what they accept is theirs,
        not the recent steps' pooled mix — at batch 1 the pooled α still describes the
        requests before this one for dozens of steps (docs/POLICIES.md, "A batch's own
        requests")."""
        requests, records = ctx.requests, engine.requests
        if len(requests) != ctx.batch_size or not records:
            return None
        if not any(r.request_id in records for r in requests):
            return None
        return ctx.batch_size, batch_tokens(self._request_alphas(engine, ctx, alpha), top)

    def _trials(
        self,
        learner: Learner,
        engine: EngineState,
        rows: BatchRows,
        point: FloatArray,
        allowed: Mask | None,
        greedy: list[int],
    ) -> dict[int, int]:
        """Per batch size (row index), a γ never run in its octave, to run now, if one is
        plausible; the rows without one are left out (nearly all, once the engine has run a
        while).

        Why: a cap on the point estimate alone can lock the policy out of a γ the
        extrapolation mispriced, and Thompson draws escape it slowly: the posterior is narrow
        in the directions the small batches excited. One decode step pins the fit there.
        Only the best γ and its neighbours: goodput is unimodal in γ, so as the trials move
        the best the search climbs to the peak and stops there, without paying for γ far
        down the curve. How far behind a trial may be predicted grows with the octave's
        measured misfit: a smooth engine the fit extrapolates well pays for few trials, one
        whose first steps there came out far off the fit tries the γ the fit may have
        mispriced as badly. At most Γmax + 1 steps per octave and engine; a trial that lands
        in a step carrying prefill leaves its cell unrun and is not repeated
        (docs/POLICIES.md, "Trials")."""
        cap = self._params.trial_loss_cap
        if cap <= 0.0:
            return {}
        octaves = rows.octaves
        # Per octave, the γ never run there nor started (their outcome is on its way).
        fresh = {
            octave: {
                g
                for g in learner.correction.unrun(octave, point.shape[1] - 1)
                if (octave, g) not in engine.trials
            }
            for octave in dict.fromkeys(octaves)
        }
        if not any(fresh.values()):
            return {}
        # Per octave, the best γ that have a fresh cell among themselves and their
        # neighbours: any other row has nothing to try (most rows, nearly always).
        near = {
            octave: {g + d for g in cells for d in (-1, 0, 1)} for octave, cells in fresh.items()
        }
        # Never a trial that turns speculation off where turning it back on costs a
        # catch-up: the switch cost then keeps the next decisions at γ = 0 (docs/POLICIES.md,
        # "Trials").
        switch_back = self._prefill_cost is not None
        weights = learner.step_time.fit().weights
        misfits: dict[int, float] = {}  # per octave, all it depends on of the batch size
        tried: dict[int, int] = {}
        for row, (octave, best) in enumerate(zip(octaves, greedy, strict=True)):
            if best not in near[octave]:
                continue
            cells = fresh[octave]
            untried = [
                g
                for g in (best - 1, best, best + 1)  # the best and its neighbours, ascending
                if g in cells
                and (allowed is None or allowed[row, g])
                and not (g == 0 and switch_back and best > 0)
            ]
            if not untried:
                continue
            goodput = point[row].tolist()
            misfit = misfits.get(octave)
            if misfit is None:
                misfit = misfits[octave] = learner.correction.misfit(weights, rows.sizes[row])
            least = (1.0 - max(cap, min(misfit, 1.0))) * goodput[best]
            plausible = [g for g in untried if goodput[g] >= least]
            if plausible:
                tried[row] = max(plausible, key=lambda g: (goodput[g], -g))
        return tried

    def _allowed(self, ms: FloatArray, tokens: FloatArray) -> Mask | None:
        """Per batch size (row), the γ a decision may pick: all (None) without a TPOT SLO;
        with one, those whose point-estimate TPOT meets it, or the lowest-TPOT γ alone when
        none does (from the point estimate the greedy choice is made on, so it is predicted
        once)."""
        slo = self._params.tpot_slo_ms
        if slo <= 0:
            return None
        tpot = ms / tokens
        meeting: Mask = tpot <= slo
        missed = np.flatnonzero(~meeting.any(axis=1))
        meeting[missed, tpot[missed].argmin(axis=1)] = True  # ties: the smaller γ
        return meeting

    def _engine_from_json(self, data: Mapping[str, Any]) -> EngineState:
        # Absent from goodput/3 states and older: no request records, none observed.
        observed = _count(data.get("observed_steps", 0), "observed_steps")
        previous = data["previous_gamma"]
        if previous is not None and not (
            _is_int(previous) and 0 <= previous <= self._params.gamma_max
        ):
            raise ValueError(f"previous_gamma must be None or in 0..{self._params.gamma_max}")
        learner_id = data["learner"]
        if not isinstance(learner_id, str):
            raise TypeError("an engine's learner must be a string")
        return EngineState(
            rng=_generator_from_state(data["rng"]),
            learner_id=learner_id,
            previous_gamma=previous,
            # Absent from states written before the trials: none started.
            trials=_trials_from_json(data.get("trials", []), self._params.gamma_max),
            requests=records_from_json(data.get("requests", {}), observed),
            observed_steps=observed,
            # Absent from states before "auto", and forced modes keep none: batch, learning.
            mode=_mode_from_json(data.get("request_mode")),
        )

    def _learner_to_json(self, learner: Learner) -> dict[str, Any]:
        return {
            "alpha": learner.acceptance.alpha,
            "acceptance": learner.acceptance.to_json(),
            "step_time": learner.step_time.to_json(),
            "correction": learner.correction.to_json(),
            "steps": learner.steps,
            "prefill_tokens": learner.prefill_tokens,
            "context_per_request": learner.context_per_request,
            "min_draft_passes": learner.min_draft_passes,
            # Derived, for people (nightjarctl state): not read back by load_state.
            "best_gamma": self._summary(learner) if learner.steps else {},
            **({"fleet": learner.fleet.to_json(learner)} if learner.fleet else {}),
        }

    def _summary(self, learner: Learner) -> dict[str, list[float]]:
        """Batch size (powers of two) → [best γ, predicted goodput tok/s] at the learner's
        recent context length, from a fit of every step (a read: the fit in use is kept)."""
        fit = learner.step_time.solve()
        out: dict[str, list[float]] = {}
        for batch in (1 << k for k in range(9)):
            ctx = StepContext(
                "",
                batch,
                context_tokens=round(learner.context_per_request * batch),
                min_draft_passes=learner.min_draft_passes,
            )
            point = self._point(learner, ctx, self._params.gamma_max, fit)
            goodput = [
                1000.0 * batch * t / max(float(ms), 1e-9)
                for t, ms in zip(point.tokens, point.step_ms, strict=True)
            ]
            best = max(range(len(goodput)), key=lambda g: (goodput[g], -g))
            out[str(batch)] = [best, round(goodput[best], 1)]
        return out

    def _learner_from_json(self, data: Mapping[str, Any]) -> Learner:
        p = self._params
        learner = Learner(
            AcceptanceModel.from_json(data["acceptance"], self._acceptance_decay),
            StepTimeModel.from_json(data["step_time"], self._time_decay, p.ridge),
            LocalCorrection.from_json(
                data.get("correction", []),
                self._correction_decay,
                p.correction_prior_steps,
                p.gamma_max,
            ),
            steps=_count(data["steps"], "steps"),
            prefill_tokens=float(data["prefill_tokens"]),
            context_per_request=float(data.get("context_per_request", 0.0)),
            # Absent from states written before v1.6's field: an engine that sent none.
            min_draft_passes=int(data.get("min_draft_passes", 0)),
            fleet=FleetShare.from_json(data.get("fleet"), p.gamma_max),
        )
        if not 0 <= learner.min_draft_passes <= p.gamma_max:
            raise ValueError(f"min_draft_passes must be in 0..{p.gamma_max}")
        means = (learner.prefill_tokens, learner.context_per_request)
        if not all(math.isfinite(m) and m >= 0 for m in means):
            raise ValueError("token means must be finite and >= 0")
        return learner


def _tpot_ms(point: Prediction) -> list[float]:
    """Predicted ms per generated token of one request in a decode step, per γ. Decode
    only, as goodput is priced: with the recent prefill load in the step time a longer γ
    looked cheap per token, and the SLO was met for fewer requests than without the mode
    (docs/POLICIES.md, "TPOT SLO (AdaSpec, arXiv:2503.05096)")."""
    return [ms / tokens for ms, tokens in zip(point.step_ms.tolist(), point.tokens, strict=True)]


def _best(goodput: FloatArray, allowed: Mask | None) -> npt.NDArray[np.intp]:
    """Per row, the allowed γ (all: None) with the best goodput; ties go to the smaller γ
    (less draft work for the same predicted goodput: argmax takes the first)."""
    if allowed is not None:
        goodput = np.where(allowed, goodput, -np.inf)
    best: npt.NDArray[np.intp] = goodput.argmax(axis=1)
    return best


def _contested(goodput: FloatArray, allowed: Mask | None, keep: float) -> bool:
    """Whether a row has an allowed γ besides its greedy one that the exploration cap
    lets a draw choose: one not below ``keep`` times the greedy γ's point goodput."""
    rows = len(goodput)
    # The greedy γ's goodput, the allowed maximum (a NaN's, as argmax takes a NaN first).
    best = (goodput if allowed is None else np.where(allowed, goodput, -np.inf)).max(axis=1)
    within: Mask = ~(goodput < keep * best[:, None])  # as the cap compares (a NaN is not below)
    if allowed is not None:
        within &= allowed
    # Each row's greedy γ is within (allowed, and goodput is positive, never below a
    # fraction of itself): some row has another where there are more than one per row.
    return int(np.count_nonzero(within)) > rows


@functools.cache
def _choice(gamma: int, kind: BinType) -> Choice:
    """The (immutable) choice of ``gamma`` as ``kind``, shared: a table holds one per size,
    and building a frozen dataclass for each costs more than the lookup."""
    return Choice(gamma=gamma, bin_type=kind)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(value: Any, name: str) -> int:
    """A step count read from a state: an integer in 0..count_limit()."""
    if not (_is_int(value) and 0 <= value <= count_limit()):
        raise ValueError(f"{name} must be an integer in 0..{count_limit()}")
    return int(value)


def _trials_from_json(data: Any, gamma_max: int) -> Trials:
    trials = frozenset((int(octave), int(gamma)) for octave, gamma in data)
    if not all(0 <= o <= MAX_OCTAVE and 0 <= g <= gamma_max for o, g in trials):
        raise ValueError(f"trials need octave in 0..{MAX_OCTAVE} and γ in 0..{gamma_max}")
    return trials


def _mode_from_json(data: Any) -> RequestMode:
    """An engine's "auto" mode from its state; a fresh one where it holds none (a state
    written before it, or under a forced mode)."""
    if not isinstance(data, Mapping) or "checks" not in data:
        return RequestMode()
    return RequestMode.from_json(data)


def _new_engine(rng: SplitMix64, learner_id: str) -> EngineState:
    # A PCG64 stream seeded from the engine's own SplitMix64 stream.
    return EngineState(Generator(PCG64(rng.next_u64())), learner_id)


def _generator_from_state(state: Mapping[str, Any]) -> Generator:
    bit_generator = PCG64()
    # numpy checks the layout (ValueError/TypeError on a malformed state).
    bit_generator.state = dict(state)  # type: ignore[assignment]
    return Generator(bit_generator)
