"""Nightjar: per-batch-size adaptive bin-greedy bandit with a switching cost.

Follows DESIGN §3 and Algorithm 1 of the Nightjar paper (seed 001): for each
batch-size context B an independent block/bin/round schedule decides whether
the current bin explores (probability 1/√b_B, γ uniform over 0..Γmax) or
exploits (Eq. 3: argmin over γ of 1/g̃[B,γ] + 1(γ_prev=0 ∧ γ>0)·c_prefill(L_max,B)/γ).
Deviations from the paper are listed in docs/POLICIES.md.
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
    PolicyError,
    feasible_gamma_max,
    learner_id,
    learner_id_of_key,
    load_prefill_cost,
    own_learner,
    parse_params,
)
from policy_server.policies.rng import SplitMix64

log = logging.getLogger(__name__)

STATE_SCHEMA = "nightjar/1"
BUCKETINGS = ("exact", "pow2")


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
        if not 1 <= self.max_batch_size <= 1 << 20:
            raise PolicyError(f"max_batch_size must be in 1..{1 << 20}, got {self.max_batch_size}")
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


@dataclasses.dataclass(frozen=True, slots=True)
class _Checkpoint:
    engine: EngineState
    rng_state: int
    previous_gamma: int | None
    key: int
    schedule: BinSchedule | None


class NightjarPolicy:
    name: ClassVar[str] = "nightjar"
    state_schema: ClassVar[str] = STATE_SCHEMA

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        self._params = parse_params(NightjarParams, params, self.name)
        self._arms = self._params.gamma_max + 1
        self._prefill_cost = load_prefill_cost(self._params.prefill_cost_table, self.name)
        self._engines: dict[str, EngineState] = {}
        self._learners: dict[str, dict[int, ArmStats]] = {}

    # -- Policy protocol -------------------------------------------------------------

    @property
    def gamma_max(self) -> int:
        return self._params.gamma_max

    def params(self) -> dict[str, Any]:
        return dataclasses.asdict(self._params)

    def decide(self, ctx: StepContext) -> Choice:
        engine = self._engine(ctx)
        top = feasible_gamma_max(ctx, self._params.gamma_max)
        if top == 0:
            # Only γ=0 is feasible: not a bandit round, the schedule does not move.
            engine.previous_gamma = 0
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
        engine = self._engine(ctx)
        stats = self._stats(engine.learner_id, self.context_key(ctx.batch_size))
        stats.update(outcome.gamma, outcome.goodput)
        if engine.previous_gamma == choice.gamma:
            # The engine ran something else than decided (clamped): that is γ_prev now.
            engine.previous_gamma = outcome.gamma

    def checkpoint(self, ctx: StepContext) -> object:
        """What decide(ctx) may change: the engine's RNG, γ_prev and the schedule of
        ctx's batch-size context (the whole engine when decide would create it)."""
        engine = self._engines.get(ctx.engine_id)
        if engine is None:
            return None
        key = self.context_key(ctx.batch_size)
        schedule = engine.schedules.get(key)
        return _Checkpoint(
            engine, engine.rng.state, engine.previous_gamma, key,
            None if schedule is None else dataclasses.replace(schedule),
        )  # fmt: skip

    def restore(self, ctx: StepContext, saved: object) -> None:
        if saved is None:
            self._engines.pop(ctx.engine_id, None)
            return
        assert isinstance(saved, _Checkpoint)
        engine = self._engines[ctx.engine_id] = saved.engine
        engine.rng.state, engine.previous_gamma = saved.rng_state, saved.previous_gamma
        if saved.schedule is None:
            engine.schedules.pop(saved.key, None)
        else:
            engine.schedules[saved.key] = dataclasses.replace(saved.schedule)

    def forget_learner(self, learner_key: str) -> None:
        """Drop the tables learned under ``learner_key`` (the server bounds how many it
        holds, evicting the least recently used key; see policy_server/engines.py)."""
        self._learners.pop(learner_id_of_key(learner_key), None)

    def state(self, engine_id: str | None = None) -> dict[str, Any]:
        engines = {
            eid: e for eid, e in self._engines.items() if engine_id is None or eid == engine_id
        }
        learner_ids = (
            set(self._learners) if engine_id is None else {e.learner_id for e in engines.values()}
        )
        return {
            "schema": STATE_SCHEMA,
            "gamma_max": self._params.gamma_max,
            "engines": {eid: _engine_to_json(e) for eid, e in sorted(engines.items())},
            "learners": {
                lid: {
                    str(key): {"means": list(s.means), "counts": list(s.counts)}
                    for key, s in sorted(self._learners[lid].items())
                }
                for lid in sorted(learner_ids)
                if lid in self._learners
            },
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        if state.get("schema") != STATE_SCHEMA:
            raise PolicyError(f"state schema {state.get('schema')!r} is not {STATE_SCHEMA}")
        if state.get("gamma_max") != self._params.gamma_max:
            raise PolicyError(
                f"state was learned with gamma_max={state.get('gamma_max')}, "
                f"this policy has gamma_max={self._params.gamma_max}"
            )
        try:
            engines = {str(eid): _engine_from_json(e) for eid, e in dict(state["engines"]).items()}
            learners = {
                str(lid): {int(k): _stats_from_json(v, self._arms) for k, v in dict(ctxs).items()}
                for lid, ctxs in dict(state["learners"]).items()
            }
        except (KeyError, TypeError, ValueError) as exc:
            raise PolicyError(f"malformed nightjar state: {exc!r}") from exc
        self._engines, self._learners = engines, learners

    def reset(self, engine_id: str | None = None) -> None:
        if engine_id is None:
            self._engines.clear()
            self._learners.clear()
            return
        engine = self._engines.pop(engine_id, None)
        if engine is not None and engine.learner_id == own_learner(engine_id):
            self._learners.pop(engine.learner_id, None)

    # -- internals ----------------------------------------------------------------------

    def context_key(self, batch_size: int) -> int:
        """The batch-size context B a step belongs to."""
        b = min(max(batch_size, 1), self._params.max_batch_size)
        if self._params.batch_bucketing == "pow2":
            return 1 << (b.bit_length() - 1)
        return b

    def _engine(self, ctx: StepContext) -> EngineState:
        engine = self._engines.get(ctx.engine_id)
        if engine is None:
            learner = learner_id(ctx, self._params.share_learner)
            # Per-engine RNG streams keep decisions reproducible whatever the interleaving.
            rng = SplitMix64(f"{self._params.seed}:{ctx.engine_id}")
            schedules = self._inherited_schedules(learner)
            engine = EngineState(rng=rng, learner_id=learner, schedules=schedules)
            self._engines[ctx.engine_id] = engine
        if ctx.previous_gamma is not None:
            engine.previous_gamma = ctx.previous_gamma
        return engine

    def _inherited_schedules(self, learner_id: str) -> dict[int, BinSchedule]:
        """A new engine on a learner with history (a replaced pod, another replica) starts
        each context where the learner's furthest engine is, not at block 1, whose first
        bins would explore again what the learner already knows (docs/POLICIES.md)."""
        inherited: dict[int, BinSchedule] = {}
        for other in self._engines.values():
            if other.learner_id != learner_id:
                continue
            for key, schedule in other.schedules.items():
                current = inherited.get(key)
                if current is None or _progress(schedule) > _progress(current):
                    inherited[key] = dataclasses.replace(schedule)
        return inherited

    def _stats(self, learner_id: str, key: int) -> ArmStats:
        contexts = self._learners.setdefault(learner_id, {})
        stats = contexts.get(key)
        if stats is None:
            stats = contexts[key] = ArmStats.empty(self._arms)
        return stats

    def _exploit(self, ctx: StepContext, engine: EngineState, key: int, top: int) -> int | None:
        """Eq. 3; None when no feasible arm has a positive goodput estimate."""
        # Read only: decide() leaves the learned tables to observe() (see checkpoint).
        stats = self._learners.get(engine.learner_id, {}).get(key)
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


def _engine_from_json(data: Mapping[str, Any]) -> EngineState:
    rng = SplitMix64(int(data["rng"]))
    schedules = {int(k): BinSchedule(**v) for k, v in dict(data["schedules"]).items()}
    previous = data["previous_gamma"]
    return EngineState(
        rng=rng,
        learner_id=str(data["learner"]),
        previous_gamma=None if previous is None else int(previous),
        schedules=schedules,
    )


def _stats_from_json(data: Mapping[str, Any], arms: int) -> ArmStats:
    means = [float(x) for x in data["means"]]
    counts = [int(x) for x in data["counts"]]
    if len(means) != arms or len(counts) != arms:
        raise ValueError(f"expected {arms} arms, got {len(means)}")
    if any(not math.isfinite(m) for m in means) or any(c < 0 for c in counts):
        raise ValueError("non-finite mean or negative count")
    return ArmStats(means, counts)
