"""Offline evaluation of a policy on a decision log: what would it have chosen, and what
would that have been worth on the same engine?

A decision log holds, for every step, the context the engine sent and the outcome it
measured. Its decode steps (no prefill in the step) of each γ are an empirical table of
step time and acceptance over batch sizes. A candidate policy, with fresh state, decides
on the logged contexts in log order; each decision's outcome is drawn from the logged
decode steps of the γ it chose at the nearest batch sizes (per-request accepts drawn from
that γ's logged accepts) and fed back, so the candidate learns as it would have on that
engine. Each decode decision is valued at the pooled goodput of its γ at its batch size
against the best γ's there; the logged choices are valued the same way.

Limits, stated with every result: the batch sizes are the logged ones (a faster policy
would have shortened the queue), and a step that carried prefill is fed its logged time
plus the pooled difference between the chosen and the logged γ's decode steps.
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

from policy_server.decision_log import read_logs
from policy_server.policies import create_policy
from policy_server.service import context_from_json, outcome_from_json
from policy_server.types import BinType, Choice, StepContext, StepOutcome

# Logged steps a draw picks among (the nearest batch sizes), and that a γ's pooled goodput
# at a batch size is averaged over (more: it values decisions, it should not be noisy).
DRAW_NEIGHBOURS = 6
RATE_NEIGHBOURS = 20


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
        self._near: dict[tuple[int, int, int], list[DecodeStep]] = {}

    @property
    def gamma_top(self) -> int:
        """The largest γ such that every γ up to it has logged decode steps (and accepts)."""
        top = -1
        while top + 1 in self._steps and (top + 1 == 0 or len(self._accepts[top + 1])):
            top += 1
        return top

    def nearest(self, batch_size: int, gamma: int, count: int) -> list[DecodeStep]:
        key = (batch_size, gamma, count)
        found = self._near.get(key)
        if found is None:
            steps, batches = self._steps[gamma], self._batches[gamma]
            # Widen a window around the insertion point, then keep the closest `count`.
            at = bisect.bisect_left(batches, batch_size)
            window = steps[max(0, at - count) : at + count]
            found = sorted(window, key=lambda d: (abs(d.batch_size - batch_size), d.batch_size))
            found = self._near[key] = found[:count]
        return found

    @property
    def gammas(self) -> list[int]:
        return sorted(self._steps)

    def seconds(self, batch_size: int, gamma: int) -> float:
        """Mean time of the logged decode steps of γ nearest this batch size."""
        near = self.nearest(batch_size, gamma, RATE_NEIGHBOURS)
        return statistics.fmean(d.seconds for d in near)

    def tokens(self, gamma: int) -> float:
        """Mean tokens a request gained in a logged decode step of γ (accepted + 1)."""
        return 1.0 + (self._mean_accepted[gamma] if gamma else 0.0)

    def goodput(self, batch_size: int, gamma: int) -> float:
        """Pooled tokens/s of γ at this batch size."""
        return batch_size * self.tokens(gamma) / self.seconds(batch_size, gamma)

    def draw(
        self, batch_size: int, gamma: int, rng: np.random.Generator
    ) -> tuple[float, tuple[int, ...]]:
        """A step's seconds and per-request accepts, drawn from the logged ones."""
        near = self.nearest(batch_size, gamma, DRAW_NEIGHBOURS)
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
    # Decode decisions valued (batch ≥ min_batch), and the mean value per seed: the
    # candidate's pooled goodput over the best γ's, 1.0 = always the best γ.
    decisions: int
    values: list[float]
    # The logged choices on the same steps, valued the same way; their policy names.
    logged_value: float
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
        steps.append(LoggedStep(
            context_from_json(decision["context"]), outcome_from_json(joined.outcome),
            str(decision.get("policy", "")), str(decision.get("policy_version", "")),
        ))  # fmt: skip
    return steps


def evaluate(
    steps: Sequence[LoggedStep], policy: str, params: Mapping[str, Any] | None = None, *,
    seeds: int = 6, min_batch: int = 1, version: str = "",
) -> Evaluation:  # fmt: skip
    """Run ``policy`` (fresh, seeds 0..seeds-1) on the logged contexts (of ``version``
    only, when given); the decode steps of the whole log are the engine it runs on."""
    table = DecodeSteps(steps)
    top = table.gamma_top
    if top < 1:
        raise EvaluationError(
            "the log needs decode steps at γ = 0 and γ = 1 at least (with per-request "
            f"accepts); it has them for γ in {table.gammas}"
        )
    replayed = [s for s in steps if not version or s.policy_version == version]
    if not replayed:
        raise EvaluationError(f"no decisions with outcomes of policy version {version!r}")
    # Learning policies take the seed too; the outcome draws always do.
    seeded = "seed" in create_policy(policy, params).params()
    values = [
        _run(table, replayed, policy, {**(params or {}), **({"seed": seed} if seeded else {})},
             seed, min_batch, top)
        for seed in range(seeds)
    ]  # fmt: skip
    decisions, logged = _value_logged(table, replayed, min_batch, top)
    return Evaluation(
        policy, dict(params or {}), seeds, min_batch, top, decisions, values, logged,
        sorted({s.policy for s in replayed}),
    )  # fmt: skip


def _value(table: DecodeSteps, batch_size: int, gamma: int, top: int) -> float:
    rates = [table.goodput(batch_size, g) for g in range(top + 1)]
    return rates[gamma] / max(rates)


def _valued(step: LoggedStep, min_batch: int) -> bool:
    return step.outcome.prefill_tokens == 0 and step.context.batch_size >= min_batch


def _value_logged(
    table: DecodeSteps, steps: Sequence[LoggedStep], min_batch: int, top: int
) -> tuple[int, float]:
    values = [
        _value(table, s.context.batch_size, s.outcome.gamma, top)
        for s in steps
        if _valued(s, min_batch) and s.outcome.gamma <= top
    ]
    return len(values), statistics.fmean(values) if values else 0.0


def _run(
    table: DecodeSteps, steps: Sequence[LoggedStep], policy_name: str,
    params: Mapping[str, Any], seed: int, min_batch: int, top: int,
) -> float:  # fmt: skip
    policy = create_policy(policy_name, params)
    rng = np.random.default_rng(seed)
    values = []
    for step in steps:
        # The candidate decides alone: no asking ahead, γ_prev its own, γ ≤ what was logged.
        ctx = dataclasses.replace(
            step.context, candidate_batch_sizes=(), ran_decision_id="", previous_gamma=None,
            max_gamma=min(top, step.context.max_gamma or top),
        )  # fmt: skip
        gamma = min(policy.decide(ctx).gamma, top)
        batch = ctx.batch_size
        seconds, accepts = table.draw(batch, gamma, rng)
        logged = step.outcome
        if logged.prefill_tokens:
            # The prefill is the logged one; the decode part moves with γ.
            logged_gamma = min(logged.gamma, top)
            moved = table.seconds(batch, gamma) - table.seconds(batch, logged_gamma)
            seconds = max(logged.step_seconds + moved, 1e-6)
        outcome = StepOutcome(
            logged.decision_id, ctx.engine_id, gamma, seconds, batch + sum(accepts),
            drafted_tokens=gamma * batch, accepted_tokens=sum(accepts), request_accepts=accepts,
            prefill_tokens=logged.prefill_tokens,
        )  # fmt: skip
        policy.observe(ctx, Choice(gamma, BinType.FIXED), outcome)
        if _valued(step, min_batch):
            values.append(_value(table, batch, gamma, top))
    return statistics.fmean(values) if values else 0.0
