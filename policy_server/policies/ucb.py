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

from policy_server.policies.base import (
    PolicyError,
    feasible_gamma_max,
    learner_id,
    learner_id_of_key,
    own_learner,
    parse_params,
)
from policy_server.types import BinType, Choice, StepContext, StepOutcome

STATE_SCHEMA = "ucb/1"


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


class UcbPolicy:
    name: ClassVar[str] = "ucb"
    state_schema: ClassVar[str] = STATE_SCHEMA

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        self._params = parse_params(UcbParams, params, self.name)
        self._arms: dict[str, dict[int, ArmSet]] = {}
        self._learner_of: dict[str, str] = {}

    @property
    def gamma_max(self) -> int:
        return self._params.gamma_max

    def params(self) -> dict[str, Any]:
        return dataclasses.asdict(self._params)

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

    def state(self, engine_id: str | None = None) -> dict[str, Any]:
        learners = {lid for eid, lid in self._learner_of.items() if engine_id in (None, eid)}
        return {
            "schema": STATE_SCHEMA,
            "gamma_max": self._params.gamma_max,
            "engines": {
                eid: lid for eid, lid in sorted(self._learner_of.items())
                if engine_id in (None, eid)
            },
            "learners": {
                lid: {str(b): a.to_json() for b, a in sorted(self._arms[lid].items())}
                for lid in sorted(learners) if lid in self._arms
            },
        }  # fmt: skip

    def load_state(self, state: Mapping[str, Any]) -> None:
        if state.get("schema") != STATE_SCHEMA or state.get("gamma_max") != self.gamma_max:
            raise PolicyError(f"state is not {STATE_SCHEMA} with gamma_max={self.gamma_max}")
        arms_per_set = self.gamma_max + 1
        try:
            engines = {str(k): str(v) for k, v in dict(state["engines"]).items()}
            learners: dict[str, dict[int, ArmSet]] = {}
            for lid, buckets in dict(state["learners"]).items():
                learners[str(lid)] = {}
                for bucket, data in dict(buckets).items():
                    sums = [float(x) for x in data["sums"]]
                    counts = [int(x) for x in data["counts"]]
                    arms = ArmSet(sums, counts, float(data["best"]))
                    if len(arms.sums) != arms_per_set or len(arms.counts) != arms_per_set:
                        raise ValueError(f"expected {arms_per_set} arms")
                    if not all(math.isfinite(s) for s in arms.sums) or min(arms.counts) < 0:
                        raise ValueError("non-finite sum or negative count")
                    learners[str(lid)][int(bucket)] = arms
        except (KeyError, TypeError, ValueError) as exc:
            raise PolicyError(f"malformed ucb state: {exc!r}") from exc
        self._learner_of, self._arms = engines, learners

    def forget_learner(self, learner_key: str) -> None:
        """Drop what was learned under ``learner_key`` (the server bounds how many keys it
        holds and evicts the least recently used; see policies/base.py)."""
        self._arms.pop(learner_id_of_key(learner_key), None)

    def reset(self, engine_id: str | None = None) -> None:
        if engine_id is None:
            self._learner_of.clear()
            self._arms.clear()
            return
        learner = self._learner_of.pop(engine_id, None)
        if learner == own_learner(engine_id):
            self._arms.pop(learner, None)

    def _arm_set(self, ctx: StepContext) -> ArmSet:
        learner = self._learner_of.get(ctx.engine_id)
        if learner is None:
            learner = self._learner_of[ctx.engine_id] = learner_id(ctx, self._params.share_learner)
        buckets = self._arms.setdefault(learner, {})
        bucket = bucket_of(ctx.batch_size)
        arms = buckets.get(bucket)
        if arms is None:
            arms = buckets[bucket] = ArmSet([0.0] * (self.gamma_max + 1),
                                            [0] * (self.gamma_max + 1))  # fmt: skip
        return arms
