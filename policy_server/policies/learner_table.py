"""The state of policies whose whole state is per learner (dsd, ucb): a LearnerTable, and
the LearnedState built on it.

Such a policy keeps, per learner, one value (dsd: an acceptance model; ucb: arm sets per
batch bucket) and, per engine, only which learner it updates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Generic, TypeVar

from nightjar_common.types import StepContext
from policy_server.policies.base import (
    UNOWNED,
    CheckpointedDecide,
    GammaParams,
    MalformedStateError,
    ParamsPolicy,
    PolicyError,
    learner_id,
)
from policy_server.policies.engine_state import LearnerBook

L = TypeVar("L")
G = TypeVar("G", bound=GammaParams)


class LearnerTable(LearnerBook[str, L]):
    """Engine id → learner id, and each learner's value: the bookkeeping of policies whose
    whole state is per learner (dsd, ucb)."""

    def _learner_id(self, engine: str) -> str:
        return engine

    def learner_of(self, ctx: StepContext) -> str:
        learner = self.engines.get(ctx.engine_id)
        if learner is None:
            learner = self.engines[ctx.engine_id] = learner_id(ctx, self.share_learner)
        return learner

    def get(self, ctx: StepContext) -> L:
        """The learned value of the step's learner (created on first use)."""
        return self.learner(self.learner_of(ctx))

    def replace(self, ctx: StepContext, value: L) -> None:
        self.learners[self.learner_of(ctx)] = value

    def to_json(
        self, engine_id: str | None, learner_json: Callable[[L], Any]
    ) -> dict[str, dict[str, Any]]:
        """``engines`` and ``learners`` of a policy state (one engine's part when given, the
        learners no engine updates with UNOWNED; see LearnedState.state)."""
        if engine_id is None:
            engines = dict(sorted(self.engines.items()))
            ids = set(self.learners)
        elif engine_id == UNOWNED:
            engines = {}
            ids = set(self.learners) - set(self.engines.values())
        else:
            learner = self.engines.get(engine_id)
            engines = {} if learner is None else {engine_id: learner}
            ids = set(engines.values())
        learners = {
            lid: learner_json(self.learners[lid]) for lid in sorted(ids) if lid in self.learners
        }
        return {"engines": engines, "learners": learners}

    def load(self, state: Mapping[str, Any], learner_from_json: Callable[[Any], L]) -> None:
        """Replace the table from a state's ``engines`` and ``learners``; raises KeyError,
        TypeError or ValueError (and changes nothing) when they do not fit."""
        engines = {str(e): lid for e, lid in dict(state["engines"]).items()}
        if not all(isinstance(lid, str) for lid in engines.values()):
            raise TypeError("engines must map engine ids to learner ids (strings)")
        learners = {str(lid): learner_from_json(v) for lid, v in dict(state["learners"]).items()}
        self.engines, self.learners = engines, learners


@dataclasses.dataclass(frozen=True, slots=True)
class _Entries:
    """Which of the entries decide(ctx) creates exist: the engine's learner id, its
    learner, and the learner's part for the step (ucb: the batch bucket's arms)."""

    engine: bool
    learner: bool
    part: bool


class LearnerTablePolicy(ParamsPolicy[G], CheckpointedDecide, Generic[G, L]):
    """LearnedState and TentativeDecisions of a policy whose whole state is a LearnerTable
    (dsd, ucb).

    Their decide() changes nothing but to create the entries it reads when they are
    missing (the engine's learner, a batch bucket's arms), empty as a first use makes
    them: a checkpoint says which exist, restoring it drops the ones made since, and
    committing a candidate makes them again."""

    name: ClassVar[str]
    state_schema: ClassVar[str]
    _table: LearnerTable[L]

    def _learner_to_json(self, learned: L) -> Any:
        raise NotImplementedError

    def _learner_from_json(self, data: Any) -> L:
        """A learner's value from its JSON; KeyError, TypeError or ValueError if malformed."""
        raise NotImplementedError

    def state(self, engine_id: str | None = None) -> dict[str, Any]:
        return {
            "schema": self.state_schema,
            "gamma_max": self.gamma_max,
            **self._table.to_json(engine_id, self._learner_to_json),
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        if state.get("schema") != self.state_schema or state.get("gamma_max") != self.gamma_max:
            raise PolicyError(f"state is not {self.state_schema} with gamma_max={self.gamma_max}")
        try:
            self._table.load(state, self._learner_from_json)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise MalformedStateError(f"malformed {self.name} state: {exc!r}") from exc

    def forget_learner(self, learner_key: str) -> None:
        self._table.forget_learner(learner_key)

    def learner_for(self, engine_id: str, learner_key: str) -> str:
        return self._table.learner_for(engine_id, learner_key)

    def checkpoint(self, ctx: StepContext) -> object:
        table = self._table
        learned = table.learners.get(table.learner_for(ctx.engine_id, ctx.learner_key))
        return _Entries(
            ctx.engine_id in table.engines,
            learned is not None,
            learned is not None and self._has_part(learned, ctx),
        )

    def restore(self, ctx: StepContext, saved: object) -> None:
        """Drop the entries made since ``saved`` (CheckpointedDecide undoing a candidate
        right after deciding it, under the same lock)."""
        assert isinstance(saved, _Entries)
        table = self._table
        learner = table.learner_for(ctx.engine_id, ctx.learner_key)
        learned = table.learners.get(learner)
        if not saved.learner:
            table.learners.pop(learner, None)
        elif learned is not None and not saved.part:
            self._drop_part(learned, ctx)
        if not saved.engine:
            table.engines.pop(ctx.engine_id, None)

    def commit(self, ctx: StepContext, decided: object) -> None:
        """Make the entries deciding made (never drop any: other steps may have made and
        filled them since the table was decided)."""
        assert isinstance(decided, _Entries)
        if decided.part:
            self._make_entries(ctx)

    def _make_entries(self, ctx: StepContext) -> None:
        """Create what decide(ctx) reads, where missing."""
        self._table.get(ctx)

    def _has_part(self, learned: L, ctx: StepContext) -> bool:
        """Whether ``learned`` holds what decide(ctx) reads of it (all of it by default)."""
        return True

    def _drop_part(self, learned: L, ctx: StepContext) -> None:
        """Drop from ``learned`` what decide(ctx) made of it (nothing by default)."""

    def reset(self, engine_id: str | None = None) -> None:
        self._table.reset(engine_id)
