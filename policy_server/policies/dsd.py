"""SmartSpec / DSD: γ = argmax of goodput under an offline-fitted linear latency model.

After SmartSpec (Liu et al., "Optimizing Speculative Decoding for Serving Large Language
Models Using Goodput", arXiv:2406.14066; code ``LiuXiaoxuanPKU/vllm`` branch ``dsd``,
``vllm/spec_decode/dsd.py``, and its V1 port ``vllm/v1/spec_decode/auto_tuner.py``):

- goodput(k) = B·(1 − α^{k+1})/(1 − α) / (target(B·(k+1), context) + k·draft(B)), with the
  k = 0 goodput multiplied by ``off_bias`` (1.1, SmartSpec's conservative bias to spec-off);
- the latency model is linear and fitted once, offline (``fit_latency`` from profiled
  steps): target = a + b·batched tokens + c·context tokens, draft pass = d + e·B;
- α starts at ``start_alpha`` (0.7) and follows the engine's accepted/drafted counters
  over a window; when it falls below 0.3 it is reset to 0.65, as SmartSpec does.

Unlike the ``goodput`` policy nothing of the latency model is learned online: it is the
peer that shows what an offline profile buys and where it goes stale.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import numpy as np

from nightjar_common.types import BinType, Choice, StepContext, StepOutcome
from policy_server.policies.base import PolicyError, feasible_gamma_max, parse_params
from policy_server.policies.learner_table import LearnerTable, LearnerTablePolicy
from policy_server.policies.models import AcceptanceModel, expected_tokens

STATE_SCHEMA = "dsd/1"
RESET_BELOW, RESET_TO = 0.3, 0.65


@dataclasses.dataclass(frozen=True, slots=True)
class DsdParams:
    gamma_max: int = 4
    # Target forward (ms): [fixed, per batched token, per context token]. Defaults: the
    # V1 port's Llama-70B/TP4/H100 coefficients (fixed 18.35 ms, c_compute, c_kv).
    target_ms: list[float] = dataclasses.field(default_factory=lambda: [18.35, 0.064, 6.24e-5])
    # One draft pass (ms): [fixed, per request] (the V1 port: ~4 % of the target).
    draft_ms: list[float] = dataclasses.field(default_factory=lambda: [0.73, 0.0])
    start_alpha: float = 0.7
    alpha_window_steps: int = 200
    off_bias: float = 1.1
    share_learner: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.gamma_max <= 64:
            raise PolicyError(f"gamma_max must be in 1..64, got {self.gamma_max}")
        for name, size in (("target_ms", 3), ("draft_ms", 2)):
            values = getattr(self, name)
            if len(values) != size or not all(
                isinstance(v, int | float) and math.isfinite(v) and abs(v) <= 1e6 for v in values
            ):
                raise PolicyError(f"{name} must be {size} finite numbers")
        if not 0.0 < self.start_alpha < 1.0:
            raise PolicyError("start_alpha must be in (0, 1)")
        if not 1 <= self.alpha_window_steps <= 10_000_000:
            raise PolicyError("alpha_window_steps must be in 1..10000000")
        if not 0.0 < self.off_bias <= 10.0:
            raise PolicyError("off_bias must be in (0, 10]")


def fit_latency(steps: Iterable[tuple[int, int, int, float]]) -> dict[str, list[float]]:
    """Least-squares ``target_ms``/``draft_ms`` from profiled (B, γ, context tokens, ms) steps:
    the offline profiling SmartSpec does once per model and hardware."""
    rows, times = [], []
    for batch, gamma, context, ms in steps:
        rows.append([1.0, batch * (gamma + 1), context, gamma, gamma * batch])
        times.append(ms)
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
    a, b, c, d, e = (float(v) for v in coef)
    return {"target_ms": [a, b, c], "draft_ms": [d, e]}


class DsdPolicy(LearnerTablePolicy[DsdParams, AcceptanceModel]):
    name: ClassVar[str] = "dsd"
    state_schema: ClassVar[str] = STATE_SCHEMA

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        self._params = parse_params(DsdParams, params, self.name)
        self._decay = 1.0 - 1.0 / self._params.alpha_window_steps
        self._table = LearnerTable(
            self._params.share_learner, lambda: self._prior(self._params.start_alpha)
        )

    def decide(self, ctx: StepContext) -> Choice:
        top = feasible_gamma_max(ctx, self._params.gamma_max)
        if top == 0:
            return Choice(gamma=0, bin_type=BinType.FORCED)
        alpha = self._table.get(ctx).alpha
        a, b, c = self._params.target_ms
        d, e = self._params.draft_ms
        batch = ctx.batch_size

        def goodput(k: int) -> float:
            ms = a + b * batch * (k + 1) + c * ctx.context_tokens + k * (d + e * batch)
            value = batch * expected_tokens(alpha, k) / max(ms, 1e-6)
            return value * self._params.off_bias if k == 0 else value

        return Choice(gamma=max(range(top + 1), key=goodput), bin_type=BinType.EXPLOIT)

    def observe(self, ctx: StepContext, choice: Choice, outcome: StepOutcome) -> None:
        model = self._table.get(ctx)
        model.observe(
            outcome.gamma, outcome.drafted_tokens, outcome.accepted_tokens, outcome.request_accepts
        )
        if model.alpha < RESET_BELOW:
            self._table.replace(ctx, self._prior(RESET_TO))

    def _learner_to_json(self, learned: AcceptanceModel) -> Any:
        return learned.to_json()

    def _learner_from_json(self, data: Any) -> AcceptanceModel:
        return AcceptanceModel.from_json(data, self._decay)

    def _prior(self, alpha: float) -> AcceptanceModel:
        # A prior worth one small step: the first counters move it.
        return AcceptanceModel.with_prior(alpha, 4.0, self._decay)
