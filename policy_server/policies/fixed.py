"""Non-learning policies: `static` (γ = k), `off` (γ = 0), `table` (batch size → γ), `random`.

`table` has the shape of vLLM's dynamic-SD schedule
(``speculative_config.num_speculative_tokens_per_batch_size = [[start_bs, end_bs, K], ...]``),
so an operator can move an existing vLLM setting into Nightjar unchanged. Its lookup
(``nightjar_common.fallback``) is also the client's local fail-open fallback.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from nightjar_common.fallback import DEFAULT_SCHEDULE, BatchSizeTable, ScheduleError, check_schedule
from nightjar_common.types import BinType, Choice, StepContext, StepOutcome
from policy_server.policies.base import (
    CheckpointedDecide,
    DecideChangesNothing,
    NothingLearned,
    ParamsPolicy,
    PolicyError,
    feasible_gamma_max,
    forced_choice_if_no_speculation,
    parse_params,
)
from policy_server.policies.engine_state import engine_rng
from policy_server.policies.rng import SplitMix64


class _LearnsNothing(DecideChangesNothing):
    """A policy that learns nothing and whose decide() changes nothing: no LearnedState
    (the server keeps none for it), every tentative decision the one it would make."""

    def observe(self, ctx: StepContext, choice: Choice, outcome: StepOutcome) -> None:
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class StaticParams:
    gamma: int = 3

    def __post_init__(self) -> None:
        if not 0 <= self.gamma <= 64:
            raise PolicyError(f"gamma must be in 0..64, got {self.gamma}")


class StaticPolicy(_LearnsNothing):
    """Always the same γ (vLLM's default behaviour with num_speculative_tokens = γ)."""

    name: ClassVar[str] = "static"

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        self._params = parse_params(StaticParams, params, self.name)

    @property
    def gamma_max(self) -> int:
        return self._params.gamma

    def params(self) -> dict[str, Any]:
        return dataclasses.asdict(self._params)

    def decide(self, ctx: StepContext) -> Choice:
        # γ = 0 configured is the operator's choice (as `off`), not one forced on it.
        forced = forced_choice_if_no_speculation(ctx, self.gamma_max) if self.gamma_max else None
        # Within the engine's max_gamma, as `table`: the configured γ is an upper bound.
        gamma = feasible_gamma_max(ctx, self.gamma_max)
        return forced or Choice(gamma=gamma, bin_type=BinType.FIXED)


@dataclasses.dataclass(frozen=True, slots=True)
class OffParams:
    pass


class OffPolicy(_LearnsNothing):
    """Never speculate (γ = 0): plain decoding, the baseline."""

    name: ClassVar[str] = "off"

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        parse_params(OffParams, params, self.name)

    @property
    def gamma_max(self) -> int:
        return 0

    def params(self) -> dict[str, Any]:
        return {}

    def decide(self, ctx: StepContext) -> Choice:
        return Choice(gamma=0, bin_type=BinType.FIXED)


@dataclasses.dataclass(frozen=True, slots=True)
class TableParams:
    # [[start_bs, end_bs, gamma], ...], inclusive ranges, as in vLLM's dynamic SD.
    schedule: list[list[int]] = dataclasses.field(
        default_factory=lambda: [list(row) for row in DEFAULT_SCHEDULE]
    )
    # γ for batch sizes no range covers.
    default_gamma: int = 0

    def __post_init__(self) -> None:
        try:
            check_schedule(self.schedule, self.default_gamma)
        except ScheduleError as exc:
            raise PolicyError(str(exc)) from None


class TablePolicy(_LearnsNothing):
    """γ looked up from a batch-size table (vLLM's dynamic-SD schedule)."""

    name: ClassVar[str] = "table"

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        self._params = parse_params(TableParams, params, self.name)
        self._table = BatchSizeTable(self._params.schedule, self._params.default_gamma)

    @property
    def gamma_max(self) -> int:
        return self._table.gamma_max

    def params(self) -> dict[str, Any]:
        return {
            "schedule": [list(r) for r in self._table.rows],
            "default_gamma": self._params.default_gamma,
        }

    def gamma_for(self, batch_size: int) -> int:
        return self._table.gamma_for(batch_size)

    def decide(self, ctx: StepContext) -> Choice:
        forced = forced_choice_if_no_speculation(ctx, self.gamma_max)
        if forced:
            return forced
        gamma = self.gamma_for(ctx.batch_size)
        if ctx.max_gamma > 0:
            gamma = min(gamma, ctx.max_gamma)
        return Choice(gamma=gamma, bin_type=BinType.FIXED)


@dataclasses.dataclass(frozen=True, slots=True)
class RandomParams:
    gamma_max: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.gamma_max <= 64:
            raise PolicyError(f"gamma_max must be in 0..64, got {self.gamma_max}")


class RandomPolicy(ParamsPolicy[RandomParams], CheckpointedDecide, NothingLearned):
    """γ uniform in 0..gamma_max every step, seeded per engine.

    Learns nothing (its LearnedState: an empty state; a reset restarts the engines' RNGs):
    a canary for losslessness (outputs must not depend on γ) and a
    uniform-propensity logging policy for off-policy evaluation of the decision log.
    """

    name: ClassVar[str] = "random"

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        self._params = parse_params(RandomParams, params, self.name)
        self._rngs: dict[str, SplitMix64] = {}

    def decide(self, ctx: StepContext) -> Choice:
        top = feasible_gamma_max(ctx, self.gamma_max)
        if top == 0:
            return Choice(gamma=0, bin_type=BinType.FORCED)
        rng = self._rngs.get(ctx.engine_id)
        if rng is None:
            rng = self._rngs[ctx.engine_id] = engine_rng(self._params.seed, ctx.engine_id)
        return Choice(
            gamma=rng.randint(0, top), bin_type=BinType.EXPLORE, exploration_probability=1.0
        )

    def observe(self, ctx: StepContext, choice: Choice, outcome: StepOutcome) -> None:
        return None

    def checkpoint(self, ctx: StepContext) -> object:
        """decide(ctx) only draws from (or creates) the engine's RNG."""
        rng = self._rngs.get(ctx.engine_id)
        return None if rng is None else rng.state

    def restore(self, ctx: StepContext, saved: object) -> None:
        if saved is None:
            self._rngs.pop(ctx.engine_id, None)
        else:
            assert isinstance(saved, int)
            self._rngs.setdefault(ctx.engine_id, SplitMix64()).state = saved

    def reset(self, engine_id: str | None = None) -> None:
        if engine_id is None:
            self._rngs.clear()
        else:
            self._rngs.pop(engine_id, None)
