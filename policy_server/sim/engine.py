"""Discrete-event simulation of a continuously batched engine with speculative decoding.

Each iteration is one engine step: admit waiting requests while KV blocks and
running slots allow, ask the decision source for γ for the decode batch, make
room for the step's KV growth (preempting the newest requests, recompute-style,
when blocks run out), fill the rest of the token budget with prefill chunks,
time the step with the hardware profile, then sample what every request
accepted. The draft's weights occupy KV blocks while it is resident.

A source that reads per-request signals (``DecisionSource.per_request``) gets each decode
request's context and recent accepts in ``StepContext.requests`` and its accepted count in
``StepOutcome.request_accepts``, and may answer a γ_i per request (``Decided``): the
drafter then runs the batch γ (the cap) and each request verifies its own γ_i.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from nightjar_common.types import RequestSignals, StepContext, StepOutcome
from policy_server.policies.models import FloatArray
from policy_server.policies.per_request import Plan, PlanRows, best_plan
from policy_server.sim.acceptance import Acceptance, accepted_run, expected_tokens
from policy_server.sim.profile import HardwareProfile, Verification
from policy_server.sim.workload import RequestSpec

# Accepted counts of its latest verifications a request carries in its RequestSignals.
RECENT_ACCEPTS = 4


@dataclasses.dataclass(slots=True)
class Decided:
    """A source's answer for one step (not frozen: a frozen dataclass's construction
    costs three times as much, on every simulated step)."""

    gamma: int
    # "" when nothing is to be reported.
    decision_id: str = ""
    # γ_i by request id (str of the request's rid), each capped at ``gamma``; a request
    # not named verifies ``gamma``. () = every request verifies ``gamma``.
    request_gammas: tuple[tuple[str, int], ...] = ()


class DecisionSource(Protocol):
    """Where γ comes from: an in-process policy, the gRPC client, or the oracle."""

    # Build per-request signals for it (StepContext.requests, StepOutcome.request_accepts):
    # a cost per request and step, so only sources whose policy reads them ask.
    per_request: bool

    def decide(self, ctx: StepContext, sim: Simulator) -> Decided: ...

    def report(self, ctx: StepContext, decision_id: str, outcome: StepOutcome) -> None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class SimConfig:
    max_running: int = 256
    # Tokens per step (decode tokens first, prefill chunks fill the rest).
    max_batch_tokens: int = 8192
    gamma_max: int = 4
    # Off: a prompt is prefilled whole in one step (vLLM without chunked prefill), so a
    # long prompt stalls the decode batch behind it for that step.
    chunked_prefill: bool = True
    draft_resident: bool = True
    engine_id: str = "sim"
    seed: int = 0
    # Score every decision against the best γ under the true parameters (costs Γmax+1
    # step-time evaluations per step; the oracle's own regret is 0 by construction).
    track_regret: bool = False


@dataclasses.dataclass(slots=True)
class SimRequest:
    rid: int
    spec: RequestSpec
    alpha: float
    admitted_order: int = 0
    # Tokens that must be in the KV cache before decoding (prompt, + generated after a preemption).
    prefill_target: int = 0
    prefilled: int = 0
    generated: int = 0
    blocks: int = 0
    lag: int = 0
    preemptions: int = 0
    # Its prompt and output need more KV than the engine has: refused at arrival, as vLLM
    # refuses a request longer than the model's context (it would wait forever).
    rejected: bool = False
    # Prefill completed in the step being simulated: it samples its next token.
    just_prefilled: bool = False
    first_token_s: float | None = None
    finish_s: float | None = None
    # Draft tokens it accepted at its latest verifications (per-request sources only).
    recent_accepts: tuple[int, ...] = ()
    _expected: list[float] = dataclasses.field(default_factory=list, repr=False)

    def expected_tokens(self, gamma: int) -> float:
        """E[accepted + bonus] of one verify step with γ, under the request's true α."""
        cache = self._expected
        while len(cache) <= gamma:
            cache.append(expected_tokens(self.alpha, len(cache)))
        return cache[gamma]

    @property
    def decoding(self) -> bool:
        return self.prefilled >= self.prefill_target

    @property
    def remaining(self) -> int:
        return self.spec.output_tokens - self.generated

    @property
    def context_tokens(self) -> int:
        return self.prefilled + (self.generated if self.decoding else 0)


@dataclasses.dataclass(frozen=True, slots=True)
class StepRecord:
    time_s: float
    batch_size: int
    gamma: int
    step_s: float
    generated: int
    waiting: int
    free_blocks: int
    # Expected tokens this step lost against the best γ (0 unless SimConfig.track_regret).
    regret_tokens: float = 0.0


@dataclasses.dataclass(slots=True)
class SimResult:
    requests: list[SimRequest]
    steps: list[StepRecord]
    makespan_s: float
    total_blocks: int
    max_used_blocks: int

    @property
    def generated_tokens(self) -> int:
        return sum(r.generated for r in self.requests)

    @property
    def throughput(self) -> float:
        return self.generated_tokens / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def rejected(self) -> int:
        return sum(r.rejected for r in self.requests)

    def latencies(self) -> list[float]:
        return sorted(
            r.finish_s - r.spec.arrival_s for r in self.requests if r.finish_s is not None
        )

    @property
    def regret_tokens(self) -> float:
        return sum(step.regret_tokens for step in self.steps)

    def tpots(self) -> list[float]:
        return [
            (r.finish_s - r.first_token_s) / (r.spec.output_tokens - 1)
            for r in self.requests
            if r.finish_s is not None and r.first_token_s is not None and r.spec.output_tokens > 1
        ]


class Simulator:
    def __init__(
        self,
        profile: HardwareProfile,
        acceptance: Acceptance,
        specs: Sequence[RequestSpec],
        source: DecisionSource,
        config: SimConfig | None = None,
    ) -> None:
        self.profile = profile
        self.config = config or SimConfig()
        self.source = source
        self._rng = random.Random(self.config.seed)
        alpha_rng = random.Random(self.config.seed + 1)
        self.requests = [
            SimRequest(i, s, acceptance.at(s.arrival_s).sample_alpha(alpha_rng))
            for i, s in enumerate(sorted(specs, key=lambda s: s.arrival_s))
        ]
        self.total_blocks = profile.kv_blocks - (
            profile.draft_kv_blocks if self.config.draft_resident else 0
        )
        self.free_blocks = self.total_blocks
        self.now = 0.0
        self.waiting: collections.deque[SimRequest] = collections.deque()
        self.running: list[SimRequest] = []
        self.previous_gamma = 0
        self.step_index = 0
        self._admissions = 0
        # Set while a step is being decided, for the oracle.
        self.pending_decode: list[SimRequest] = []

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> SimResult:
        arrivals = collections.deque(self.requests)
        steps: list[StepRecord] = []
        max_used = 0
        while arrivals or self.waiting or self.running:
            while arrivals and arrivals[0].spec.arrival_s <= self.now:
                request = arrivals.popleft()
                request.rejected = (
                    self._blocks(request.spec.prompt_tokens + request.spec.output_tokens)
                    > self.total_blocks
                )
                if not request.rejected:
                    self.waiting.append(request)
            if not self.waiting and not self.running:
                if arrivals:
                    self.now = arrivals[0].spec.arrival_s
                continue
            self._admit()
            record = self._step()
            steps.append(record)
            max_used = max(max_used, self.total_blocks - self.free_blocks)
            assert self.free_blocks >= 0, "KV over-committed"
        return SimResult(self.requests, steps, self.now, self.total_blocks, max_used)

    def _blocks(self, tokens: int) -> int:
        """KV blocks that hold ``tokens`` and the next one's slot."""
        return math.ceil((tokens + 1) / self.profile.block_size)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_running:
            request = self.waiting[0]
            target = request.spec.prompt_tokens + request.generated
            needed = self._blocks(target)
            if needed > self.free_blocks:
                break
            self.waiting.popleft()
            request.prefill_target, request.prefilled = target, 0
            request.blocks = needed
            self.free_blocks -= needed
            self._admissions += 1
            request.admitted_order = self._admissions
            self.running.append(request)

    def _step(self) -> StepRecord:
        decode = [r for r in self.running if r.decoding]
        # lost: expected decode goodput the decision gives up against the best batch γ.
        gamma, decision_id, ctx, lost = 0, "", None, 0.0
        gammas: dict[int, int] | None = None  # γ_i by rid, when the source answered them
        if decode:
            ctx = StepContext(
                engine_id=self.config.engine_id,
                batch_size=len(decode),
                step_index=self.step_index,
                num_waiting=len(self.waiting),
                free_kv_blocks=self.free_blocks,
                total_kv_blocks=self.total_blocks,
                max_draft_lag_tokens=max(r.lag for r in decode),
                draft_resident=self.config.draft_resident,
                previous_gamma=self.previous_gamma,
                max_gamma=self.config.gamma_max,
                context_tokens=sum(r.context_tokens for r in decode),
                requests=signals(decode) if self.source.per_request else (),
            )
            self.pending_decode = decode
            goodputs = None
            if self.config.track_regret:
                goodputs = self.expected_goodputs(self.config.gamma_max)
            decided = self.source.decide(ctx, self)
            gamma = max(0, min(decided.gamma, self.config.gamma_max))
            decision_id = decided.decision_id
            if decided.request_gammas and gamma > 0:
                gammas = request_gammas(decided.request_gammas, decode, gamma)
            if goodputs:  # scored before the step changes the requests
                lost = max(goodputs) - self._chosen_goodput(goodputs, gamma, gammas)
            # KV for the cap: the drafter proposes it for every request before verifying.
            decode = self._reserve(decode, gamma)
        catch_up = max((r.lag for r in decode), default=0) if self.previous_gamma == 0 else 0
        verification = verification_of(decode, gammas)
        # Each request's verify tokens count against the token budget: vLLM's synchronous
        # scheduler schedules 1 + len(spec_token_ids) tokens a request, its drafts already
        # cut to γ_i (the plugin's NightjarScheduler); the drafter's KV is the cap's.
        verified = len(decode) * gamma if verification is None else verification.draft_tokens
        prefill_tokens = self._run_prefill(len(decode) + verified)
        context = sum(r.context_tokens for r in decode)
        step_s = self.profile.step_seconds(
            len(decode), gamma, prefill_tokens, context, catch_up, verification
        )
        self.now += step_s
        generated, accepted, accepts, accepted_ids = self._decode(decode, gamma, gammas)
        generated += self._first_tokens()
        self._finish()
        if ctx is not None:
            outcome = StepOutcome(
                decision_id,
                ctx.engine_id,
                gamma,
                step_s,
                generated,
                drafted_tokens=verified,
                accepted_tokens=accepted,
                request_accepts=accepts,
                prefill_tokens=prefill_tokens,
                request_ids=accepted_ids,
            )
            self.source.report(ctx, decision_id, outcome)
            self.previous_gamma = gamma
        self.step_index += 1
        regret = lost * step_s
        return StepRecord(
            self.now,
            len(decode),
            gamma,
            step_s,
            generated,
            len(self.waiting),
            self.free_blocks,
            regret,
        )

    # -- pieces of a step -------------------------------------------------------------------

    def _prefill_chunks(self, decode_tokens: int) -> list[tuple[SimRequest, int]]:
        """Prefill work of the step: decode tokens first, prefill chunks fill the budget."""
        budget = max(0, self.config.max_batch_tokens - decode_tokens)
        chunks: list[tuple[SimRequest, int]] = []
        used = 0
        for request in self.running:
            if request.decoding or used >= budget:
                continue
            left = request.prefill_target - request.prefilled
            chunk = min(left, budget - used)
            if not self.config.chunked_prefill and chunk < left:
                # Whole prompts only; one longer than the budget runs alone in its step.
                if used > 0:
                    continue
                chunk = left
            chunks.append((request, chunk))
            used += chunk
        return chunks

    def _run_prefill(self, decode_tokens: int) -> int:
        chunks = self._prefill_chunks(decode_tokens)
        for request, chunk in chunks:
            request.prefilled += chunk
            request.just_prefilled = request.decoding
        return sum(chunk for _, chunk in chunks)

    def _reserve(self, decode: list[SimRequest], gamma: int) -> list[SimRequest]:
        """Make room for every decode request's KV growth, preempting the newest if needed."""
        bs = self.profile.block_size
        while True:
            needed = {
                r.rid: max(0, math.ceil((r.context_tokens + gamma + 1) / bs) - r.blocks)
                for r in decode
            }
            if sum(needed.values()) <= self.free_blocks or not self.running:
                break
            self._preempt(max(self.running, key=lambda r: r.admitted_order))
            decode = [r for r in decode if r in self.running]
        for request in decode:
            request.blocks += needed[request.rid]
            self.free_blocks -= needed[request.rid]
        return decode

    def _preempt(self, request: SimRequest) -> None:
        self.running.remove(request)
        self.free_blocks += request.blocks
        request.blocks, request.prefilled, request.preemptions = 0, 0, request.preemptions + 1
        request.lag = 0
        self.waiting.appendleft(request)

    def _decode(
        self, decode: list[SimRequest], gamma: int, gammas: Mapping[int, int] | None
    ) -> tuple[int, int, tuple[int, ...], tuple[str, ...]]:
        """Tokens generated, draft tokens accepted, and the accepted count of each request
        that verified drafts with its request id (per-request sources only; () otherwise)."""
        generated = accepted = 0
        accepts: list[int] = []
        ids: list[str] = []
        track = self.source.per_request
        for request in decode:
            if gamma > 0:
                depth = gamma if gammas is None else gammas[request.rid]
                run = accepted_run(self._rng, request.alpha, depth)
                accepted += run
                tokens = min(run + 1, request.remaining)
                request.lag = 0  # the drafter ran the cap over every request
                if track and depth > 0:
                    accepts.append(run)
                    ids.append(str(request.rid))
                    request.recent_accepts = (*request.recent_accepts[1 - RECENT_ACCEPTS :], run)
            else:
                tokens = min(1, request.remaining)
                request.lag += tokens
            request.generated += tokens
            generated += tokens
        return generated, accepted, tuple(accepts), tuple(ids)

    def _first_tokens(self) -> int:
        """A request whose prefill completed this step samples its next token."""
        count = 0
        for request in self.running:
            if request.just_prefilled:
                request.just_prefilled = False
                if request.remaining > 0:
                    request.generated += 1
                    count += 1
                if request.first_token_s is None:
                    request.first_token_s = self.now
        return count

    def _finish(self) -> None:
        bs = self.profile.block_size
        for request in list(self.running):
            if request.remaining <= 0:
                request.finish_s = self.now
                self.running.remove(request)
                self.free_blocks += request.blocks
                request.blocks = 0
            elif request.decoding:
                # Blocks for the tokens now in the cache (growth reserved in _reserve).
                have = math.ceil((request.context_tokens + 1) / bs)
                if have > request.blocks:
                    extra = min(have - request.blocks, self.free_blocks)
                    request.blocks += extra
                    self.free_blocks -= extra

    # -- for the oracle -----------------------------------------------------------------------

    def expected_goodputs(self, top: int) -> list[float]:
        """Expected decode tokens per second of the pending step's decode work, γ = 0..top.

        Scored on the decode batch alone, from the true parameters: prefill chunks that
        share the step are left out of the time, because counting them makes speculation
        look cheap in prefill-heavy steps, and a per-step maximiser fooled that way loses
        throughput to γ = 0 under load (docs/SIMULATOR.md, "The oracle").
        """
        work = self._pending_work()
        return [self._expected_goodput(gamma, None, *work) for gamma in range(top + 1)]

    def best_request_plan(self, top: int) -> Plan:
        """The per-request plan (a cap ≤ ``top``, γ_i ≤ cap) of the best expected decode
        goodput of the pending step, from each request's true α: per_request.best_plan
        over the profile's own step time, scored as ``expected_goodputs`` scores a batch γ
        (decode work alone). What it leaves out: a request about to finish takes fewer
        tokens than its drafts would give (``expected_goodputs`` caps those)."""
        decode = self.pending_decode
        context, catch_up = self._pending_work()
        batch, step_seconds = len(decode), self.profile.step_seconds

        def price(rows: PlanRows, attention: FloatArray) -> FloatArray:
            each = zip(rows.caps.tolist(), rows.verified.tolist(), attention.tolist(), strict=True)
            return np.array(
                [
                    1000.0 * step_seconds(batch, cap, 0, context, catch_up, Verification(int(v), a))
                    for cap, v, a in each
                ]
            )

        alphas = [r.alpha for r in decode]
        return best_plan(alphas, [r.context_tokens for r in decode], top, price)

    def _pending_work(self) -> tuple[int, int]:
        """Context tokens and the draft's catch-up lag of the pending step."""
        decode = self.pending_decode
        catch_up = max((r.lag for r in decode), default=0) if self.previous_gamma == 0 else 0
        return sum(r.context_tokens for r in decode), catch_up

    def _expected_goodput(
        self, gamma: int, gammas: Mapping[int, int] | None, context: int, catch_up: int
    ) -> float:
        """Expected decode goodput of the pending step with γ (γ_i by rid: γ is their cap)."""
        decode = self.pending_decode
        if gammas is None:  # the hot path: Γmax+1 of these per step when tracking regret
            tokens = sum(min(r.expected_tokens(gamma), r.remaining) for r in decode)
        else:
            tokens = sum(min(r.expected_tokens(gammas[r.rid]), r.remaining) for r in decode)
        verification = verification_of(decode, gammas)
        seconds = self.profile.step_seconds(len(decode), gamma, 0, context, catch_up, verification)
        return tokens / seconds

    def _chosen_goodput(
        self, goodputs: list[float], gamma: int, gammas: Mapping[int, int] | None
    ) -> float:
        """Expected decode goodput of the step's decision; with per-request γ_i it can beat
        every batch γ (a negative regret)."""
        if gammas is None:
            return goodputs[gamma]
        return self._expected_goodput(gamma, gammas, *self._pending_work())


def signals(decode: Sequence[SimRequest]) -> tuple[RequestSignals, ...]:
    """What an engine knows of each decode request; no KL divergence (the simulator has no
    distributions: a policy that wants one uses its proxy)."""
    return tuple(RequestSignals(str(r.rid), r.context_tokens, r.recent_accepts) for r in decode)


def request_gammas(
    answered: Sequence[tuple[str, int]], decode: Sequence[SimRequest], cap: int
) -> dict[int, int]:
    """γ_i by rid of the decode requests, within 0..cap; a request not answered for: cap."""
    by_id = dict(answered)
    return {r.rid: max(0, min(by_id.get(str(r.rid), cap), cap)) for r in decode}


def verification_of(
    decode: Sequence[SimRequest], gammas: Mapping[int, int] | None
) -> Verification | None:
    """The step's verify work with per-request γ_i; None: every request verifies the cap."""
    if gammas is None:
        return None
    return Verification.of([gammas[r.rid] for r in decode], [r.context_tokens for r in decode])
