"""Per-engine and per-learner state of the learning policies, kept one way for all of them.

A learning policy keeps a record per engine (which learner it updates, and for goodput
and nightjar its own RNG stream and γ_prev) and, per learner, what was learned; engines
sending one learner key share a learner (base.learner_id). Here, once: creating an
engine's record with its own seeded stream, checkpointing what deciding changes in it,
forgetting one engine or all of them, forgetting a learner key, and which part of the
state one engine's view shows. (Policies whose whole state is per learner build on
LearnerBook too: learner_table.py.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar

from nightjar_common.types import Choice, StepContext
from policy_server.policies.base import (
    UNOWNED,
    CheckpointedDecide,
    GammaParams,
    ParamsPolicy,
    PolicyError,
    engine_learner_id,
    feasible_gamma_max,
    learner_id,
    learner_id_of_key,
    own_learner,
)
from policy_server.policies.rng import SplitMix64
from policy_server.prefill_cost import PrefillCostTable

E = TypeVar("E")
L = TypeVar("L")
S = TypeVar("S")
G = TypeVar("G", bound=GammaParams)


def engine_rng(seed: int, engine_id: str) -> SplitMix64:
    """The engine's own stream: its decisions are reproducible whatever the interleaving."""
    return SplitMix64(f"{seed}:{engine_id}")


class LearnerBook(Generic[E, L]):
    """``engines`` (engine id → its record) and ``learners`` (learner id → what it learned)."""

    def __init__(self, share_learner: bool, new_learner: Callable[[], L]) -> None:
        self.share_learner = share_learner
        self._new_learner = new_learner
        self.engines: dict[str, E] = {}
        self.learners: dict[str, L] = {}

    def _learner_id(self, engine: E) -> str:
        """The learner an engine's record updates."""
        raise NotImplementedError

    def learner(self, learner: str) -> L:
        """What ``learner`` has learned (created on first use)."""
        value = self.learners.get(learner)
        if value is None:
            value = self.learners[learner] = self._new_learner()
        return value

    def forget_learner(self, learner_key: str) -> None:
        self.learners.pop(learner_id_of_key(learner_key), None)

    def learner_for(self, engine_id: str, learner_key: str) -> str:
        """LearnedState.learner_for: the record's learner, else the one it would get."""
        engine = self.engines.get(engine_id)
        if engine is None:
            return engine_learner_id(engine_id, learner_key, self.share_learner)
        return self._learner_id(engine)

    def reset(self, engine_id: str | None = None) -> None:
        if engine_id is None:
            self.engines.clear()
            self.learners.clear()
            return
        engine = self.engines.pop(engine_id, None)
        # The engine's own learner goes with it; a shared one stays for the others.
        if engine is not None and self._learner_id(engine) == own_learner(engine_id):
            self.learners.pop(own_learner(engine_id), None)


class RngStream(Protocol):
    """An RNG whose whole state reads and writes as ``state`` (SplitMix64, numpy's
    bit generators). A read is a value the stream does not change later and a write copies
    it in (SplitMix64's is an int; numpy's getter builds a new dict, its setter reads one),
    so checkpoints hold states without copying them."""

    state: Any


class EngineRecord(Protocol):
    """What EngineStates reads and writes of a policy's per-engine record."""

    learner_id: str
    previous_gamma: int | None

    @property
    def stream(self) -> RngStream:
        """The engine's RNG."""
        ...


R = TypeVar("R", bound=EngineRecord)


@dataclasses.dataclass(frozen=True, slots=True)
class EngineCheckpoint(Generic[R, S]):
    """An engine's record before or after a decision: the record, its RNG state, γ_prev
    and ``part``, what else of it the policy's decide() may change."""

    engine: R
    rng_state: Any
    previous_gamma: int | None
    part: S
    # Of an exploring candidate: the choice the policy exploits at its batch size and its
    # checkpoint (TentativeDecisions.exploit); None for any other.
    exploit: tuple[Choice, object] | None = None


class EngineStates(LearnerBook[R, L]):
    """Per-engine records (each with its own RNG stream, seeded per engine) and per-learner
    state: the bookkeeping of goodput and nightjar."""

    def __init__(
        self,
        seed: int,
        share_learner: bool,
        new_engine: Callable[[SplitMix64, str], R],
        new_learner: Callable[[], L],
    ) -> None:
        super().__init__(share_learner, new_learner)
        self._seed = seed
        self._new_engine = new_engine

    def _learner_id(self, engine: R) -> str:
        return engine.learner_id

    def engine(self, ctx: StepContext) -> R:
        """The step's engine record (created on first use, from the engine's own RNG
        stream and its learner id); γ_prev is the context's when the engine sends one."""
        engine = self.engines.get(ctx.engine_id)
        if engine is None:
            rng = engine_rng(self._seed, ctx.engine_id)
            engine = self._new_engine(rng, learner_id(ctx, self.share_learner))
            self.engines[ctx.engine_id] = engine
        if ctx.previous_gamma is not None:
            engine.previous_gamma = ctx.previous_gamma
        return engine

    def selected(self, engine_id: str | None) -> tuple[dict[str, R], dict[str, L]]:
        """Engines and learners a state shows, by id: all of them, or one engine and its
        learner (found directly: the server reads states an engine at a time), or with
        UNOWNED the learners no engine updates."""
        if engine_id is None:
            engines = dict(sorted(self.engines.items()))
            ids = set(self.learners)
        elif engine_id == UNOWNED:
            engines = {}
            ids = set(self.learners) - {r.learner_id for r in self.engines.values()}
        else:
            engine = self.engines.get(engine_id)
            engines = {} if engine is None else {engine_id: engine}
            ids = {r.learner_id for r in engines.values()}
        return engines, {lid: self.learners[lid] for lid in sorted(ids) if lid in self.learners}

    def checkpoint(self, ctx: StepContext, part: Callable[[R], S]) -> EngineCheckpoint[R, S] | None:
        """What decide(ctx) may change of the engine: its RNG, γ_prev and ``part(engine)``;
        None when decide would create the engine (restore then drops it). Learners are
        left out: decide() does not change what they learned."""
        engine = self.engines.get(ctx.engine_id)
        if engine is None:
            return None
        return EngineCheckpoint(engine, engine.stream.state, engine.previous_gamma, part(engine))

    def restore(self, ctx: StepContext, saved: object, put_back: Callable[[R, Any], None]) -> None:
        """Put back what checkpoint(ctx) returned; ``put_back(engine, part)`` the part."""
        if saved is None:
            self.engines.pop(ctx.engine_id, None)
            return
        assert isinstance(saved, EngineCheckpoint)
        engine: R = saved.engine
        engine.stream.state = saved.rng_state
        engine.previous_gamma = saved.previous_gamma
        put_back(engine, saved.part)
        self.engines[ctx.engine_id] = engine


class EngineStatePolicy(ParamsPolicy[G], CheckpointedDecide, Generic[G, R, L]):
    """LearnedState plumbing of a policy whose state is EngineStates (``_book``): goodput
    and nightjar. Its checkpoints hold all its decide() changes (CheckpointedDecide)."""

    _book: EngineStates[R, L]
    # c_prefill, the catch-up of turning speculation back on (None: no table given).
    _prefill_cost: PrefillCostTable | None

    @property
    def prices_speculation_state(self) -> bool:
        """The speculation state a step starts in enters a decision only through the
        catch-up it prices (base.prices_speculation_state): none without a table."""
        return self._prefill_cost is not None

    def _checkpoint_part(self, ctx: StepContext, engine: R) -> Any:
        """A copy of what else of ``engine`` decide(ctx) may change (beyond RNG, γ_prev)."""
        raise NotImplementedError

    def _restore_part(self, engine: R, part: Any) -> None:
        """Put back what _checkpoint_part returned."""
        raise NotImplementedError

    def _engine_and_top(self, ctx: StepContext) -> tuple[R, int]:
        """The step's engine record and the largest γ it can run; at 0 (γ = 0 forced, no
        choice of the policy's) γ_prev is set to 0 already."""
        engine = self._book.engine(ctx)
        top = feasible_gamma_max(ctx, self.gamma_max)
        if top == 0:
            engine.previous_gamma = 0
        return engine, top

    def checkpoint(self, ctx: StepContext) -> object:
        return self._book.checkpoint(ctx, lambda engine: self._checkpoint_part(ctx, engine))

    def restore(self, ctx: StepContext, saved: object) -> None:
        self._book.restore(ctx, saved, self._restore_part)

    def forget_learner(self, learner_key: str) -> None:
        self._book.forget_learner(learner_key)

    def learner_for(self, engine_id: str, learner_key: str) -> str:
        return self._book.learner_for(engine_id, learner_key)

    def reset(self, engine_id: str | None = None) -> None:
        self._book.reset(engine_id)

    def _check_gamma_max(self, state: Mapping[str, Any]) -> None:
        """A state to load must have been learned with this Γmax (arms are per γ)."""
        if state.get("gamma_max") != self.gamma_max:
            raise PolicyError(
                f"state was learned with gamma_max={state.get('gamma_max')}, "
                f"this policy has gamma_max={self.gamma_max}"
            )
