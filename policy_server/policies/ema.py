"""SGLang-style adaptive speculation: EMA of accepted length, batch-size tiers, hysteresis.

Follows SGLang's ``AdaptiveStepSlot`` (sgl-project/sglang,
``python/sglang/srt/speculative/adaptive_spec_params.py``): one slot per batch-size tier, each
with its candidate steps; the EMA of accepted draft tokens per request is updated
while speculating; after a warm-up it re-targets every `update_interval` batches
(down when ema ≤ p − 0.5 + down_hysteresis, up while ema > cur − 0.5 + up_hysteresis);
a slot at step 0 probes the smallest positive step (anti-deadlock). Candidates above
`gamma_max` are clipped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from nightjar_common.types import BinType, Choice, StepContext, StepOutcome
from policy_server.policies.base import (
    CheckpointedDecide,
    MalformedStateError,
    ParamsPolicy,
    PolicyError,
    StatePerEngine,
    feasible_gamma_max,
    parse_params,
)


@dataclasses.dataclass(frozen=True, slots=True)
class EmaParams:
    gamma_max: int = 7
    ema_alpha: float = 0.2
    warmup_batches: int = 10
    update_interval: int = 5
    down_hysteresis: float = -0.25
    up_hysteresis: float = 0.0
    # [[min_batch_size, [candidate steps]], ...] (SGLang's DEFAULT_ADAPTIVE_CONFIG).
    tiers: list[list[Any]] = dataclasses.field(
        default_factory=lambda: [[1, [1, 3, 7]], [8, [0, 1, 3]], [32, [0, 1]], [64, [0]]]
    )

    def __post_init__(self) -> None:
        if not 1 <= self.gamma_max <= 64:
            raise PolicyError("gamma_max must be in 1..64")
        if not 0 < self.ema_alpha <= 1:
            raise PolicyError("ema_alpha must be in (0, 1]")
        if self.update_interval < 1 or self.warmup_batches < 0:
            raise PolicyError("update_interval must be >= 1 and warmup_batches >= 0")
        # Bounded, so a client's parameters cannot make the server allocate at will.
        if not 1 <= len(self.tiers) <= MAX_TIERS or not all(map(_valid_tier, self.tiers)):
            raise PolicyError(
                f"tiers must be 1..{MAX_TIERS} of [min_batch_size >= 0, [1..65 steps, "
                "each in 0..64]]"
            )


MAX_TIERS = 64


MAX_STEPS = 65


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: Any) -> bool:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond a float's range
        return False


def _valid_tier(tier: Any) -> bool:
    if not isinstance(tier, list | tuple) or len(tier) != 2:
        return False
    low, steps = tier
    return (
        _is_int(low)
        and low >= 0
        and isinstance(steps, list | tuple)
        and 1 <= len(steps) <= MAX_STEPS
        and all(_is_int(s) and 0 <= s <= 64 for s in steps)
    )


@dataclasses.dataclass(slots=True)
class Slot:
    candidates: list[int]
    index: int
    ema: float
    batches: int = 0

    @property
    def step(self) -> int:
        return self.candidates[self.index]


class EmaPolicy(ParamsPolicy[EmaParams], CheckpointedDecide, StatePerEngine):
    name: ClassVar[str] = "ema"
    state_schema: ClassVar[str] = "ema/1"

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        self._params = parse_params(EmaParams, params, self.name)
        self._tiers = sorted(
            (int(low), sorted({min(int(s), self._params.gamma_max) for s in steps}))
            for low, steps in self._params.tiers
        )
        self._slots: dict[str, dict[int, Slot]] = {}

    def _slot(self, engine_id: str, batch_size: int) -> Slot:
        tier = max((t for t in self._tiers if t[0] <= batch_size), default=self._tiers[0])
        slots = self._slots.setdefault(engine_id, {})
        slot = slots.get(tier[0])
        if slot is None:
            candidates = tier[1]
            index = len(candidates) // 2
            slot = slots[tier[0]] = Slot(candidates, index, float(candidates[index] - 1))
        return slot

    def decide(self, ctx: StepContext) -> Choice:
        if feasible_gamma_max(ctx, self.gamma_max) == 0:
            return Choice(gamma=0, bin_type=BinType.FORCED)
        step = min(self._slot(ctx.engine_id, ctx.batch_size).step, feasible_gamma_max(ctx, 64))
        return Choice(gamma=step, bin_type=BinType.FIXED)

    def checkpoint(self, ctx: StepContext) -> object:
        """decide() only creates the engine's slot for ctx's tier (and its table)."""
        slots = self._slots.get(ctx.engine_id)
        return None if slots is None else dict(slots)

    def restore(self, ctx: StepContext, saved: object) -> None:
        if saved is None:
            self._slots.pop(ctx.engine_id, None)
        else:
            assert isinstance(saved, dict)
            self._slots[ctx.engine_id] = dict(saved)

    def observe(self, ctx: StepContext, choice: Choice, outcome: StepOutcome) -> None:
        slot = self._slot(ctx.engine_id, ctx.batch_size)
        if outcome.gamma > 0 and ctx.batch_size > 0:
            accepted = outcome.accepted_tokens / ctx.batch_size
            a = self._params.ema_alpha
            slot.ema = (1 - a) * slot.ema + a * accepted
        slot.batches += 1
        if slot.batches < self._params.warmup_batches:
            return
        if (slot.batches - self._params.warmup_batches) % self._params.update_interval:
            return
        self._retarget(slot)

    def _retarget(self, slot: Slot) -> None:
        p = self._params
        if slot.step == 0 and len(slot.candidates) > 1:
            slot.index += 1  # probe the smallest positive step after a γ=0 interval
            return
        if slot.ema < 0:
            slot.ema = float(slot.step - 1)
        moved = False
        while slot.index > 0:
            previous = slot.candidates[slot.index - 1]
            threshold = (0.5 if previous == 0 else previous - 0.5) + p.down_hysteresis
            if slot.ema > threshold:
                break
            slot.index -= 1
            moved = True
        while not moved and slot.index + 1 < len(slot.candidates):
            if slot.ema <= slot.step - 0.5 + p.up_hysteresis:
                break
            slot.index += 1

    def state(self, engine_id: str | None = None) -> dict[str, Any]:
        if engine_id is None:
            shown = self._slots
        else:  # found directly (UNOWNED finds none: slots are per engine)
            slots = self._slots.get(engine_id)
            shown = {} if slots is None else {engine_id: slots}
        return {
            "schema": self.state_schema,
            "slots": {
                eid: {str(k): dataclasses.asdict(v) for k, v in slots.items()}
                for eid, slots in shown.items()
            },
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        if state.get("schema") != self.state_schema:
            raise PolicyError(f"state schema {state.get('schema')!r} is not {self.state_schema}")
        try:
            loaded = {
                str(eid): {int(k): Slot(**v) for k, v in dict(slots).items()}
                for eid, slots in dict(state["slots"]).items()
            }
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise MalformedStateError(f"malformed ema state: {exc!r}") from exc
        for eid, slots in loaded.items():
            for tier, slot in slots.items():
                problem = self._slot_problem(slot) or (
                    f"a tier's min_batch_size must be >= 0, got {tier}" if tier < 0 else ""
                )
                if problem:
                    raise MalformedStateError(
                        f"malformed ema state: engine {eid!r} tier {tier}: {problem}"
                    )
        self._slots = loaded  # only once every slot is checked: nothing changes on a refusal

    def _slot_problem(self, slot: Slot) -> str:
        """Why a loaded slot could not have been learned by this policy ("" if it could):
        decide() answers its candidate at its index, which must be a γ in 0..gamma_max."""
        candidates = slot.candidates
        top = self._params.gamma_max
        if not isinstance(candidates, list) or not 1 <= len(candidates) <= MAX_STEPS:
            return f"candidates must be a list of 1..{MAX_STEPS} steps"
        if not all(_is_int(c) and 0 <= c <= top for c in candidates):
            return f"candidates must be in 0..{top} (gamma_max), got {candidates}"
        if not _is_int(slot.index) or not 0 <= slot.index < len(candidates):
            return f"index must be in 0..{len(candidates) - 1}, got {slot.index!r}"
        if not _is_finite(slot.ema):
            return f"ema must be a finite number, got {slot.ema!r}"
        if not _is_int(slot.batches) or slot.batches < 0:
            return f"batches must be an integer >= 0, got {slot.batches!r}"
        return ""

    def reset(self, engine_id: str | None = None) -> None:
        if engine_id is None:
            self._slots.clear()
        else:
            self._slots.pop(engine_id, None)
