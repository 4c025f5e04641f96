"""BanditSpec-style UCB over γ, one arm set per batch-size bucket.

After BanditSpec (Hou et al., arXiv:2505.15141; ``sail-sg/BanditSpec``,
``generate_utils.py``, ``ucb_length_spec_generate``): every arm is pulled once in turn,
then γ = argmax mean + sqrt(c·ln t / N). BanditSpec runs one sequence batch of fixed
size, so here each power-of-two batch bucket (1, 2–3, 4–7, …) has its own arm set over
γ ∈ {0..Γmax} (0 added: a serving engine must be able to stop speculating).

Deviation: BanditSpec's reward is raw tokens/s, which makes the bonus negligible next to
rewards in the hundreds; rewards here are divided by the bucket's largest goodput so far,
so the bonus keeps its meaning (documented in docs/POLICIES.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from nightjar_common.types import BinType, Choice, StepContext, StepOutcome
from policy_server.policies.base import (
    PolicyError,
    count_limit,
    feasible_gamma_max,
    parse_params,
)
from policy_server.policies.learner_table import LearnerTable, LearnerTablePolicy

STATE_SCHEMA = "ucb/1"
# The largest batch bucket a state may hold.
MAX_BUCKET = 1 << 62


@dataclasses.dataclass(frozen=True, slots=True)
class UcbParams:
    gamma_max: int = 4
    # The exploration constant c of sqrt(c·ln t / N) (BanditSpec: 6).
    exploration: float = 6.0
    share_learner: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.gamma_max <= 64:
            raise PolicyError(f"gamma_max must be in 1..64, got {self.gamma_max}")
        if not (math.isfinite(self.exploration) and 0.0 <= self.exploration <= 1e3):
            raise PolicyError("exploration must be in 0..1000")


@dataclasses.dataclass(slots=True)
class ArmSet:
    sums: list[float]
    counts: list[int]
    best: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def bucket_of(batch_size: int) -> int:
    return 1 << (max(batch_size, 1).bit_length() - 1)


class UcbPolicy(LearnerTablePolicy[UcbParams, dict[int, ArmSet]]):
    name: ClassVar[str] = "ucb"
    state_schema: ClassVar[str] = STATE_SCHEMA

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        self._params = parse_params(UcbParams, params, self.name)
        # Per learner: power-of-two bucket -> its arms.
        self._table: LearnerTable[dict[int, ArmSet]] = LearnerTable(
            self._params.share_learner, dict
        )

    def decide(self, ctx: StepContext) -> Choice:
        top = feasible_gamma_max(ctx, self._params.gamma_max)
        if top == 0:
            return Choice(gamma=0, bin_type=BinType.FORCED)
        arms = self._arm_set(ctx)
        for gamma in range(top + 1):
            if arms.counts[gamma] == 0:
                return Choice(gamma=gamma, bin_type=BinType.EXPLORE)
        total = sum(arms.counts[: top + 1])
        scale = arms.best or 1.0

        def mean(g: int) -> float:
            return arms.sums[g] / arms.counts[g] / scale

        def index(g: int) -> float:
            bonus = math.sqrt(self._params.exploration * math.log(total) / arms.counts[g])
            return mean(g) + bonus

        gamma = max(range(top + 1), key=index)
        greedy = max(range(top + 1), key=mean)
        return Choice(gamma=gamma, bin_type=BinType.EXPLOIT if gamma == greedy else BinType.EXPLORE)

    def observe(self, ctx: StepContext, choice: Choice, outcome: StepOutcome) -> None:
        arms = self._arm_set(ctx)
        reward = outcome.goodput
        arms.sums[outcome.gamma] += reward
        arms.counts[outcome.gamma] += 1
        arms.best = max(arms.best, reward)

    def _learner_to_json(self, learned: dict[int, ArmSet]) -> Any:
        return {str(b): a.to_json() for b, a in sorted(learned.items())}

    def _learner_from_json(self, buckets: Any) -> dict[int, ArmSet]:
        arms_per_set = self.gamma_max + 1
        out: dict[int, ArmSet] = {}
        for bucket, data in dict(buckets).items():
            sums = [float(x) for x in data["sums"]]
            counts = [int(x) for x in data["counts"]]
            arms = ArmSet(sums, counts, float(data["best"]))
            if len(arms.sums) != arms_per_set or len(arms.counts) != arms_per_set:
                raise ValueError(f"expected {arms_per_set} arms")
            # Rewards are goodputs: sums and the best are finite and >= 0.
            if not all(math.isfinite(s) and s >= 0 for s in [*arms.sums, arms.best]):
                raise ValueError("reward sums and the best reward must be finite and >= 0")
            if not all(0 <= c <= count_limit() for c in arms.counts):
                raise ValueError(f"pull counts must be in 0..{count_limit()}")
            key = int(bucket)
            if not 1 <= key <= MAX_BUCKET or key != bucket_of(key):
                raise ValueError(f"batch bucket must be a power of two in 1..{MAX_BUCKET}")
            out[key] = arms
        return out

    def _make_entries(self, ctx: StepContext) -> None:
        self._arm_set(ctx)

    def _has_part(self, learned: dict[int, ArmSet], ctx: StepContext) -> bool:
        return bucket_of(ctx.batch_size) in learned

    def _drop_part(self, learned: dict[int, ArmSet], ctx: StepContext) -> None:
        learned.pop(bucket_of(ctx.batch_size), None)

    def _arm_set(self, ctx: StepContext) -> ArmSet:
        buckets = self._table.get(ctx)
        bucket = bucket_of(ctx.batch_size)
        arms = buckets.get(bucket)
        if arms is None:
            arms = buckets[bucket] = ArmSet(
                [0.0] * (self.gamma_max + 1), [0] * (self.gamma_max + 1)
            )
        return arms
