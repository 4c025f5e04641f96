"""Offline evaluation of a policy on a decision log: what would it have chosen, and what
would that have been worth on the same engine?

A decision log holds, for every step, the context the engine sent and the outcome it
measured. Its decode steps (no prefill in the step) of each γ are an empirical table of
step time and acceptance over batch sizes. A candidate policy, with fresh state, decides
on the logged contexts in log order; each decision's outcome is drawn from the logged
decode steps of the γ it chose at the nearest batch sizes (per-request accepts drawn from
that γ's logged accepts) and fed back, so the candidate learns as it would have on that
engine. Each decode decision is valued at the pooled goodput of its γ at its batch size
against the best γ's there; the logged choices are valued the same way. A γ is priced at
a batch size only from decode steps within ``BATCH_RATIO`` of it; a decision whose γ has
none there is counted as unpriced instead of valued, and the best γ is the best of the
priced ones.

Limits, stated with every result: the batch sizes are the logged ones (a faster policy
would have shortened the queue), a step that carried prefill is fed its logged time
plus the pooled difference between the chosen and the logged γ's decode steps, and an
unpriced choice is fed the logged steps of its γ nearest in batch size, however far.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nightjar_common.types import BinType, Choice, StepContext, StepOutcome
from policy_server.decision_log import context_from_json, outcome_from_json, read_logs
from policy_server.policies import create_policy

# Logged steps a draw picks among (the nearest batch sizes), and that price a γ's decode
# part of a prefill step where no step is near its batch size.
DRAW_NEIGHBOURS = 6
RATE_NEIGHBOURS = 20
# A logged step prices its γ at batch sizes within this ratio of its own only. Step time
# grows with B·(γ+1): pooling by nearness alone priced a γ rarely run at a large batch with
# its steps at small ones. Larger prices more decisions, less faithfully (docs/POLICIES.md,
# "Decision").
BATCH_RATIO = 1.25


class EvaluationError(ValueError):
    """The log cannot support the evaluation (e.g. a γ with no logged decode step)."""


@dataclasses.dataclass(frozen=True, slots=True)
class LoggedStep:
    context: StepContext
    outcome: StepOutcome
    policy: str
    policy_version: str


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeStep:
    batch_size: int
    seconds: float


class DecodeSteps:
    """The log's decode steps per γ, sorted by batch size: what the engine measured."""

    def __init__(self, steps: Iterable[LoggedStep]) -> None:
        by_gamma: dict[int, list[DecodeStep]] = collections.defaultdict(list)
        accepts: dict[int, list[int]] = collections.defaultdict(list)
        for step in steps:
            o = step.outcome
            # A step whose drafter ran another γ than it verified prices neither cleanly.
            if o.prefill_tokens or o.drafted_gamma != o.gamma:
                continue
            by_gamma[o.gamma].append(DecodeStep(step.context.batch_size, o.step_seconds))
            accepts[o.gamma].extend(o.request_accepts)
        self._steps = {g: sorted(s, key=lambda d: d.batch_size) for g, s in by_gamma.items()}
        self._batches = {g: [d.batch_size for d in s] for g, s in self._steps.items()}
        self._mean_accepted = {g: statistics.fmean(a) if a else 0.0 for g, a in accepts.items()}
        self._accepts = {g: np.array(a, dtype=np.int64) for g, a in accepts.items()}
        self._near: dict[tuple[int, int, int, bool], list[DecodeStep]] = {}
        self._seconds: dict[tuple[int, int], float | None] = {}

    @property
    def gamma_top(self) -> int:
        """The largest γ such that every γ up to it has logged decode steps (and accepts)."""
        top = -1
        while top + 1 in self._steps and (top + 1 == 0 or len(self._accepts[top + 1])):
            top += 1
        return top

    def nearest(
        self, batch_size: int, gamma: int, count: int, *, bounded: bool = True
    ) -> list[DecodeStep]:
        """The logged decode steps of γ closest in batch size (up to ``count``); only
        those within ``BATCH_RATIO`` of it when ``bounded``, so possibly none."""
        key = (batch_size, gamma, count, bounded)
        found = self._near.get(key)
        if found is None:
            if bounded:
                window = self._within(batch_size, gamma)
            else:  # a window around the insertion point holds the closest `count`
                at = bisect.bisect_left(self._batches[gamma], batch_size)
                window = self._steps[gamma][max(0, at - count) : at + count]
            found = sorted(window, key=lambda d: (abs(d.batch_size - batch_size), d.batch_size))
            found = self._near[key] = found[:count]
        return found

    def _within(self, batch_size: int, gamma: int) -> list[DecodeStep]:
        """The logged decode steps of γ within ``BATCH_RATIO`` of this batch size."""
        batches = self._batches[gamma]
        low = bisect.bisect_left(batches, batch_size / BATCH_RATIO)
        return self._steps[gamma][low : bisect.bisect_right(batches, batch_size * BATCH_RATIO)]

    @property
    def gammas(self) -> list[int]:
        return sorted(self._steps)

    def shortfall(self) -> str:
        """What keeps gamma_top below 1, in words."""
        missing = [g for g in (0, 1) if g not in self._steps]
        found = f"decode steps at γ {self.gammas}" if self._steps else "no decode steps"
        if missing:
            return f"it has {found}, none at γ {' or '.join(map(str, missing))}"
        return f"it has {found}, but those at γ 1 carry no per-request accepts"

    def seconds(self, batch_size: int, gamma: int) -> float | None:
        """Time of a decode step of γ at this batch size from the logged steps within
        ``BATCH_RATIO`` of it (None: the log has none): their mean, or where they span
        batch sizes, a line through them (step time grows with B; a mean of steps at 54
        and 60 would price 64 low). A line that falls with B is noise; the mean is used.
        Cached: every valued decision prices every γ."""
        key = (batch_size, gamma)
        if key not in self._seconds:
            self._seconds[key] = _line_or_mean(self._within(batch_size, gamma), batch_size)
        return self._seconds[key]

    def tokens(self, gamma: int) -> float:
        """Mean tokens a request gained in a logged decode step of γ (accepted + 1)."""
        return 1.0 + (self._mean_accepted[gamma] if gamma else 0.0)

    def goodput(self, batch_size: int, gamma: int) -> float | None:
        """Pooled tokens/s of γ at this batch size (None: unpriced there)."""
        seconds = self.seconds(batch_size, gamma)
        return None if seconds is None else batch_size * self.tokens(gamma) / seconds

    def draw(
        self, batch_size: int, gamma: int, rng: np.random.Generator
    ) -> tuple[float, tuple[int, ...]]:
        """A step's seconds and per-request accepts, drawn from the logged ones (from
        the nearest in batch size, however far, when none is near)."""
        near = self.nearest(batch_size, gamma, DRAW_NEIGHBOURS) or self.nearest(
            batch_size, gamma, DRAW_NEIGHBOURS, bounded=False
        )
        seconds = near[int(rng.integers(len(near)))].seconds
        if gamma == 0:
            return seconds, ()
        return seconds, tuple(int(a) for a in rng.choice(self._accepts[gamma], size=batch_size))


@dataclasses.dataclass(frozen=True, slots=True)
class Evaluation:
    policy: str
    params: dict[str, Any]
    seeds: int
    min_batch: int
    gamma_top: int
    # Decode decisions (batch ≥ min_batch), and per seed the mean value of the priced
    # ones (the candidate's pooled goodput over the best priced γ's, 1.0 = always the
    # best γ) and how many were unpriced (no logged step of their γ near their batch).
    decisions: int
    values: list[float]
    unpriced: list[int]
    # The logged choices on the same steps, valued the same way; their policy names.
    logged_value: float
    logged_unpriced: int
    logged_policies: list[str]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)


def read_log(paths: Iterable[str | Path]) -> list[LoggedStep]:
    """Joined decisions with outcomes, in decision order (rotated backups included)."""
    steps = []
    for joined in read_logs(paths):
        if joined.outcome is None:
            continue
        decision = joined.decision
        steps.append(
            LoggedStep(
                context_from_json(decision["context"]),
                outcome_from_json(joined.outcome),
                str(decision.get("policy", "")),
                str(decision.get("policy_version", "")),
            )
        )
    return steps


def evaluate(
    steps: Sequence[LoggedStep],
    policy: str,
    params: Mapping[str, Any] | None = None,
    *,
    seeds: int = 6,
    min_batch: int = 1,
    version: str = "",
) -> Evaluation:
    """Run ``policy`` (fresh, seeds 0..seeds-1) on the logged contexts (of ``version``
    only, when given); the decode steps of the whole log are the engine it runs on."""
    table = DecodeSteps(steps)
    top = table.gamma_top
    if top < 1:
        raise EvaluationError(
            "the log needs decode steps at γ = 0 and γ = 1 at least, those at γ ≥ 1 with "
            f"per-request accepts (a nightjar or goodput log has them): {table.shortfall()}"
        )
    replayed = [s for s in steps if not version or s.policy_version == version]
    if not replayed:
        raise EvaluationError(f"no decisions with outcomes of policy version {version!r}")
    # Learning policies take the seed too; the outcome draws always do.
    seeded = "seed" in create_policy(policy, params).params()
    runs = [
        _run(
            table,
            replayed,
            policy,
            {**(params or {}), **({"seed": seed} if seeded else {})},
            seed,
            min_batch,
            top,
        )
        for seed in range(seeds)
    ]
    logged = _summary(
        [
            _value(table, s.context.batch_size, s.outcome.gamma, top)
            for s in replayed
            if _valued(s, min_batch) and s.outcome.gamma <= top
        ]
    )
    return Evaluation(
        policy,
        dict(params or {}),
        seeds,
        min_batch,
        top,
        sum(_valued(s, min_batch) for s in replayed),
        [value for value, _ in runs],
        [unpriced for _, unpriced in runs],
        logged[0],
        logged[1],
        sorted({s.policy for s in replayed}),
    )


def _value(table: DecodeSteps, batch_size: int, gamma: int, top: int) -> float | None:
    """γ's pooled goodput at this batch size over the best priced γ's there (None: γ
    is unpriced there)."""
    rates = {g: table.goodput(batch_size, g) for g in range(top + 1)}
    rate = rates[gamma]
    return None if rate is None else rate / max(r for r in rates.values() if r is not None)


def _summary(values: Sequence[float | None]) -> tuple[float, int]:
    """The mean of the priced values and the count of the unpriced."""
    priced = [v for v in values if v is not None]
    return (statistics.fmean(priced) if priced else 0.0), len(values) - len(priced)


def _valued(step: LoggedStep, min_batch: int) -> bool:
    return step.outcome.prefill_tokens == 0 and step.context.batch_size >= min_batch


def _run(
    table: DecodeSteps,
    steps: Sequence[LoggedStep],
    policy_name: str,
    params: Mapping[str, Any],
    seed: int,
    min_batch: int,
    top: int,
) -> tuple[float, int]:
    policy = create_policy(policy_name, params)
    rng = np.random.default_rng(seed)
    values: list[float | None] = []
    for step in steps:
        # The candidate decides alone: γ_prev its own, γ ≤ what was logged.
        ctx = dataclasses.replace(
            step.context,
            previous_gamma=None,
            max_gamma=min(top, step.context.max_gamma or top),
        )
        gamma = min(policy.decide(ctx).gamma, top)
        batch = ctx.batch_size
        seconds, accepts = table.draw(batch, gamma, rng)
        logged = step.outcome
        if logged.prefill_tokens:
            # The prefill is the logged one; the decode part moves with γ.
            logged_gamma = min(logged.gamma, top)
            moved = _seconds(table, batch, gamma) - _seconds(table, batch, logged_gamma)
            seconds = max(logged.step_seconds + moved, 1e-6)
        outcome = StepOutcome(
            logged.decision_id,
            ctx.engine_id,
            gamma,
            seconds,
            batch + sum(accepts),
            drafted_tokens=gamma * batch,
            accepted_tokens=sum(accepts),
            request_accepts=accepts,
            prefill_tokens=logged.prefill_tokens,
        )
        policy.observe(ctx, Choice(gamma, BinType.FIXED), outcome)
        if _valued(step, min_batch):
            values.append(_value(table, batch, gamma, top))
    return _summary(values)


def _seconds(table: DecodeSteps, batch_size: int, gamma: int) -> float:
    """Pooled decode seconds of γ at this batch size, from the nearest steps however far
    when none is near (a prefill step's decode part only needs a difference)."""
    seconds = table.seconds(batch_size, gamma)
    if seconds is None:
        near = table.nearest(batch_size, gamma, RATE_NEIGHBOURS, bounded=False)
        seconds = statistics.fmean(d.seconds for d in near)
    return seconds


def _line_or_mean(steps: Sequence[DecodeStep], batch_size: int) -> float | None:
    if not steps:
        return None
    mean = statistics.fmean(d.seconds for d in steps)
    if len({d.batch_size for d in steps}) < 2:
        return mean
    slope, intercept = np.polyfit([d.batch_size for d in steps], [d.seconds for d in steps], 1)
    return float(slope * batch_size + intercept) if slope > 0 else mean
