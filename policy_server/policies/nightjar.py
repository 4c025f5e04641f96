"""Nightjar: per-batch-size adaptive bin-greedy bandit with a switching cost.

Follows Algorithm 1 of the Nightjar paper (arXiv:2512.22420): for each
batch-size context B an independent block/bin/round schedule decides whether
the current bin explores (probability 1/√b_B, γ uniform over 0..Γmax) or
exploits (Eq. 3: argmin over γ of 1/g̃[B,γ] + 1(γ_prev=0 ∧ γ>0)·c_prefill(L_max,B)/γ).
Deviations from the paper are listed in docs/POLICIES.md, "Deviations from the paper (where
it is ambiguous or silent)".
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from nightjar_common.types import BinType, Choice, StepContext, StepOutcome
from policy_server.policies.base import (
    FILE_PATH,
    MalformedStateError,
    PolicyError,
    count_limit,
    load_prefill_cost,
    parse_params,
)
from policy_server.policies.engine_state import EngineStatePolicy, EngineStates
from policy_server.policies.rng import SplitMix64

log = logging.getLogger(__name__)

STATE_SCHEMA = "nightjar/1"
BUCKETINGS = ("exact", "pow2")
# The largest max_batch_size, and so batch-size context, of a state.
MAX_BATCH_SIZE = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class NightjarParams:
    # Arms are γ ∈ {0..gamma_max}; match the engine's num_speculative_tokens.
    gamma_max: int = 4
    # Batch sizes above this share the context of max_batch_size (clamp).
    max_batch_size: int = 256
    # "exact": one context per batch size; "pow2": contexts 1, 2-3, 4-7, ...
    batch_bucketing: str = "exact"
    seed: int = 0
    # Learned goodput is keyed by StepContext.learner_key when the engine sends one (the
    # plugin sends model@device): engines of one model and hardware learn together, and a
    # replaced pod (new engine id, same key) goes on from what was learned. False: one
    # table per engine id. Engines that send no key always learn alone.
    share_learner: bool = True
    # CSV of c_prefill(L_max, B) (see policy_server/prefill_cost.py); "" = no switching cost.
    prefill_cost_table: str = dataclasses.field(default="", metadata=FILE_PATH)

    def __post_init__(self) -> None:
        if not 1 <= self.gamma_max <= 64:
            raise PolicyError(f"gamma_max must be in 1..64, got {self.gamma_max}")
        if not 1 <= self.max_batch_size <= MAX_BATCH_SIZE:
            raise PolicyError(
                f"max_batch_size must be in 1..{MAX_BATCH_SIZE}, got {self.max_batch_size}"
            )
        if self.batch_bucketing not in BUCKETINGS:
            raise PolicyError(f"batch_bucketing must be one of {BUCKETINGS}")


@dataclasses.dataclass(slots=True)
class BinSchedule:
    """Algorithm 1's per-context counters: block j, block length H, bin b, round τ."""

    block: int = 1
    block_length: int = 1
    bin: int = 1
    round: int = 1
    explore: bool = True

    def exploration_probability(self) -> float:
        return 1.0 / math.sqrt(self.bin)

    def advance(self) -> None:
        """Lines 16–22: end the round, then possibly the bin and the block."""
        self.round += 1
        limit = math.sqrt(self.block_length)
        if self.round > limit:
            self.bin += 1
            self.round = 1
            if self.bin > limit:
                self.block += 1
                self.block_length = 2 ** (self.block - 1)
                self.bin = 1


@dataclasses.dataclass(slots=True)
class ArmStats:
    """Incremental goodput means g̃[B, γ] and pull counts for one context."""

    means: list[float]
    counts: list[int]

    @classmethod
    def empty(cls, arms: int) -> ArmStats:
        return cls([0.0] * arms, [0] * arms)

    def update(self, gamma: int, reward: float) -> None:
        self.counts[gamma] += 1
        self.means[gamma] += (reward - self.means[gamma]) / self.counts[gamma]


@dataclasses.dataclass(slots=True)
class EngineState:
    """What belongs to one engine: its RNG, its γ_prev and its schedules."""

    rng: SplitMix64
    learner_id: str
    previous_gamma: int | None = None
    schedules: dict[int, BinSchedule] = dataclasses.field(default_factory=dict)

    @property
    def stream(self) -> SplitMix64:
        return self.rng


class NightjarPolicy(EngineStatePolicy[NightjarParams, EngineState, dict[int, ArmStats]]):
    name: ClassVar[str] = "nightjar"
    state_schema: ClassVar[str] = STATE_SCHEMA

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        self._params = parse_params(NightjarParams, params, self.name)
        self._arms = self._params.gamma_max + 1
        self._prefill_cost = load_prefill_cost(self._params.prefill_cost_table, self.name)
        # Per learner: batch-size context -> goodput means of its arms.
        self._book: EngineStates[EngineState, dict[int, ArmStats]] = EngineStates(
            self._params.seed, self._params.share_learner, self._new_engine, dict
        )

    # -- Policy protocol -------------------------------------------------------------

    def decide(self, ctx: StepContext) -> Choice:
        engine, top = self._engine_and_top(ctx)
        if top == 0:
            # Only γ=0 is feasible: not a bandit round, the schedule does not move.
            return Choice(gamma=0, bin_type=BinType.FORCED)
        key = self.context_key(ctx.batch_size)
        schedule = engine.schedules.get(key)
        if schedule is None:
            schedule = engine.schedules[key] = BinSchedule()
        probability = schedule.exploration_probability()
        if schedule.round == 1:
            schedule.explore = engine.rng.random() < probability
        gamma = None
        if not schedule.explore:
            gamma = self._exploit(ctx, engine, key, top)
        bin_type = BinType.EXPLOIT
        if gamma is None:
            # Exploration bin, or no arm has a goodput estimate yet (see docs/POLICIES.md).
            gamma = engine.rng.randint(0, top)
            bin_type = BinType.EXPLORE
        schedule.advance()
        engine.previous_gamma = gamma
        return Choice(gamma=gamma, bin_type=bin_type, exploration_probability=probability)

    def observe(self, ctx: StepContext, choice: Choice, outcome: StepOutcome) -> None:
        engine = self._book.engine(ctx)
        stats = self._stats(engine.learner_id, self.context_key(ctx.batch_size))
        stats.update(outcome.gamma, outcome.goodput)
        if engine.previous_gamma == choice.gamma:
            # The engine ran something else than decided (clamped): that is γ_prev now.
            engine.previous_gamma = outcome.gamma

    # -- LearnedState protocol (with EngineStatePolicy) ----------------------------------

    def _checkpoint_part(self, ctx: StepContext, engine: EngineState) -> Any:
        """decide(ctx) advances (or creates) the schedule of ctx's batch-size context."""
        key = self.context_key(ctx.batch_size)
        schedule = engine.schedules.get(key)
        return key, None if schedule is None else dataclasses.replace(schedule)

    def _restore_part(self, engine: EngineState, part: Any) -> None:
        key, schedule = part
        if schedule is None:
            engine.schedules.pop(key, None)
        else:
            engine.schedules[key] = dataclasses.replace(schedule)

    def state(self, engine_id: str | None = None) -> dict[str, Any]:
        engines, learners = self._book.selected(engine_id)
        return {
            "schema": STATE_SCHEMA,
            "gamma_max": self._params.gamma_max,
            "engines": {eid: _engine_to_json(e) for eid, e in engines.items()},
            "learners": {
                lid: {
                    str(key): {"means": list(s.means), "counts": list(s.counts)}
                    for key, s in sorted(contexts.items())
                }
                for lid, contexts in learners.items()
            },
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        if state.get("schema") != STATE_SCHEMA:
            raise PolicyError(f"state schema {state.get('schema')!r} is not {STATE_SCHEMA}")
        self._check_gamma_max(state)
        top = self._params.gamma_max
        try:
            engines = {
                str(eid): _engine_from_json(e, top) for eid, e in dict(state["engines"]).items()
            }
            learners = {
                str(lid): {
                    _context_key(k): _stats_from_json(v, self._arms) for k, v in dict(ctxs).items()
                }
                for lid, ctxs in dict(state["learners"]).items()
            }
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise MalformedStateError(f"malformed nightjar state: {exc!r}") from exc
        # Only once all of it is checked: nothing changes on a refusal.
        self._book.engines, self._book.learners = engines, learners

    # -- internals ----------------------------------------------------------------------

    def context_key(self, batch_size: int) -> int:
        """The batch-size context B a step belongs to."""
        b = min(max(batch_size, 1), self._params.max_batch_size)
        if self._params.batch_bucketing == "pow2":
            return 1 << (b.bit_length() - 1)
        return b

    def _new_engine(self, rng: SplitMix64, learner_id: str) -> EngineState:
        schedules = self._inherited_schedules(learner_id)
        return EngineState(rng=rng, learner_id=learner_id, schedules=schedules)

    def _inherited_schedules(self, learner_id: str) -> dict[int, BinSchedule]:
        """A new engine on a learner with history (a replaced pod, another replica) starts
        each context where the learner's furthest engine is, not at block 1, whose first
        bins would explore again what the learner already knows (docs/POLICIES.md)."""
        inherited: dict[int, BinSchedule] = {}
        for other in self._book.engines.values():
            if other.learner_id != learner_id:
                continue
            for key, schedule in other.schedules.items():
                current = inherited.get(key)
                if current is None or _progress(schedule) > _progress(current):
                    inherited[key] = dataclasses.replace(schedule)
        return inherited

    def _stats(self, learner_id: str, key: int) -> ArmStats:
        contexts = self._book.learner(learner_id)
        stats = contexts.get(key)
        if stats is None:
            stats = contexts[key] = ArmStats.empty(self._arms)
        return stats

    def _exploit(self, ctx: StepContext, engine: EngineState, key: int, top: int) -> int | None:
        """Eq. 3; None when no feasible arm has a positive goodput estimate."""
        # Read only: decide() leaves the learned tables to observe() (see checkpoint).
        stats = self._book.learners.get(engine.learner_id, {}).get(key)
        if stats is None:
            return None
        switching = engine.previous_gamma == 0 and self._prefill_cost is not None
        c_prefill = (
            self._prefill_cost.seconds_at(ctx.max_draft_lag_tokens, ctx.batch_size)
            if switching and self._prefill_cost is not None
            else 0.0
        )
        best, best_cost = None, math.inf
        for gamma in range(top + 1):
            mean = stats.means[gamma]
            if stats.counts[gamma] == 0 or mean <= 0.0:
                continue  # g̃ = 0: infinite cost
            cost = 1.0 / mean
            if gamma > 0 and c_prefill:
                cost += c_prefill / gamma
            if cost < best_cost:
                best, best_cost = gamma, cost
        return best

    def switching_cost_seconds(self, lag_tokens: int, batch_size: int) -> float:
        """c_prefill(L_max, B) in seconds (0 without a table)."""
        if self._prefill_cost is None:
            return 0.0
        return self._prefill_cost.seconds_at(lag_tokens, batch_size)


def _progress(schedule: BinSchedule) -> tuple[int, int, int]:
    return schedule.block, schedule.bin, schedule.round


def _engine_to_json(engine: EngineState) -> dict[str, Any]:
    return {
        "learner": engine.learner_id,
        "previous_gamma": engine.previous_gamma,
        "rng": engine.rng.state,
        "schedules": {str(k): dataclasses.asdict(s) for k, s in sorted(engine.schedules.items())},
    }


def _engine_from_json(data: Mapping[str, Any], gamma_max: int) -> EngineState:
    """An engine's record, every value in the range this policy could have written
    (ValueError otherwise): γ_prev in 0..gamma_max, the RNG a 64-bit state, schedules of
    Algorithm 1 (see _schedule_from_json)."""
    rng = data["rng"]
    if not _is_int(rng) or not 0 <= rng < 1 << 64:
        raise ValueError(f"rng must be an integer in 0..2^64-1, got {rng!r}")
    schedules = {
        _context_key(k): _schedule_from_json(v) for k, v in dict(data["schedules"]).items()
    }
    previous = data["previous_gamma"]
    if previous is not None and (not _is_int(previous) or not 0 <= previous <= gamma_max):
        raise ValueError(f"previous_gamma must be null or in 0..{gamma_max}, got {previous!r}")
    learner = data["learner"]
    if not isinstance(learner, str):
        raise TypeError(f"learner must be a string, got {learner!r}")
    return EngineState(
        rng=SplitMix64(rng),
        learner_id=learner,
        previous_gamma=previous,
        schedules=schedules,
    )


# The largest block a schedule can reach: block j lasts 2^(j-1) bins of rounds, so the
# 64th starts after more than 2^62 steps.
MAX_BLOCK = 64


def _schedule_from_json(data: Mapping[str, Any]) -> BinSchedule:
    """A BinSchedule as advance() leaves it: block in 1..MAX_BLOCK, its length 2^(block-1),
    bin and round in 1..isqrt(length)+1, explore a boolean (ValueError otherwise)."""
    schedule = BinSchedule(**data)
    counters = (schedule.block, schedule.block_length, schedule.bin, schedule.round)
    if not all(_is_int(c) for c in counters) or not isinstance(schedule.explore, bool):
        raise TypeError(f"schedule counters must be integers, explore a boolean: {dict(data)}")
    if not 1 <= schedule.block <= MAX_BLOCK or schedule.block_length != 2 ** (schedule.block - 1):
        raise ValueError(f"schedule block must be in 1..{MAX_BLOCK}, its length 2^(block-1)")
    limit = math.isqrt(schedule.block_length) + 1
    if not (1 <= schedule.bin <= limit and 1 <= schedule.round <= limit):
        raise ValueError(f"schedule bin and round must be in 1..{limit}: {dict(data)}")
    return schedule


def _context_key(key: Any) -> int:
    """A batch-size context of a state: 1..MAX_BATCH_SIZE (ValueError otherwise)."""
    value = int(key)
    if not 1 <= value <= MAX_BATCH_SIZE:
        raise ValueError(f"batch-size context must be in 1..{MAX_BATCH_SIZE}, got {key!r}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _stats_from_json(data: Mapping[str, Any], arms: int) -> ArmStats:
    """Goodput means (finite, >= 0: goodput is) and pull counts (0..2^63) of each arm."""
    means = [float(x) for x in data["means"]]
    counts = [int(x) for x in data["counts"]]
    if len(means) != arms or len(counts) != arms:
        raise ValueError(f"expected {arms} arms, got {len(means)}")
    if not all(math.isfinite(m) and m >= 0 for m in means):
        raise ValueError("goodput means must be finite and >= 0")
    if not all(0 <= c <= count_limit() for c in counts):
        raise ValueError(f"pull counts must be in 0..{count_limit()}")
    return ArmStats(means, counts)
