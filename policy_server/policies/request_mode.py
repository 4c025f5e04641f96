"""Whether the goodput policy plans γ per request on an engine, decided by the policy itself.

With ``per_request: "auto"`` (the default) an engine starts on the batch γ. Every few of
its steps the policy prices the best per-request plan for the step's requests against the
best batch γ for the same requests (per_request.best_plan gives both), each request's α
first pulled towards the pooled α by ``sure_z`` standard errors of its own estimate, so
that estimation noise alone cannot make requests look apart (``sure_alphas``). What the
plan gains over the batch γ, as a fraction of its goodput, is averaged over the recent
checks (``GainAverage``). The engine plans per request once that average's lower bound
(``sure_z`` standard errors below) clears ``gain_on``, and goes back to the batch γ once
its upper bound falls under ``gain_off``: hysteresis, so a gain near one margin does not
flap. A forced mode (``per_request: true | false``) and an engine that cannot apply
per-request γ (EngineRuntime.request_gammas_applied) skip all of this.

Pure arithmetic; nothing of engines or the wire (docs/POLICIES.md, "Per-request mode").
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from typing import Any

from policy_server.policies.per_request import RequestRecord


class Reason(enum.StrEnum):
    """Why an engine is in its mode (a metric label: a handful of values)."""

    FORCED_ON = "forced_on"
    FORCED_OFF = "forced_off"
    # The engine runs per-request γ only partly or not at all (its runtime says so).
    ENGINE_CANNOT_APPLY = "engine_cannot_apply"
    # A TPOT SLO filters batch γ: plans are never searched with it.
    TPOT_SLO = "tpot_slo"
    # Too few checks yet to be sure either way.
    LEARNING = "learning"
    GAIN_ABOVE_MARGIN = "gain_above_margin"
    GAIN_BELOW_MARGIN = "gain_below_margin"


@dataclasses.dataclass(frozen=True, slots=True)
class ModeParams:
    gain_on: float
    gain_off: float
    # Checks (not steps) the gain average remembers.
    window_checks: int
    # Checks before the average may engage the mode.
    min_checks: int
    sure_z: float


@dataclasses.dataclass(slots=True)
class GainAverage:
    """Exponentially forgotten mean and variance of the checks' gains, with the forgotten
    count of checks they rest on (what the standard error divides by)."""

    weight: float = 0.0
    mean: float = 0.0
    # Forgotten sum of squared deviations (Welford's, weighted).
    spread: float = 0.0

    def add(self, gain: float, decay: float) -> None:
        self.weight = decay * self.weight + 1.0
        delta = gain - self.mean
        self.mean += delta / self.weight
        self.spread = decay * self.spread + delta * (gain - self.mean)

    def bounds(self, z: float) -> tuple[float, float]:
        """The mean ± z standard errors (unbounded until two checks)."""
        if self.weight <= 1.0:
            return -math.inf, math.inf
        variance = max(self.spread, 0.0) / (self.weight - 1.0)
        error = z * math.sqrt(variance / self.weight)
        return self.mean - error, self.mean + error


@dataclasses.dataclass(slots=True)
class RequestMode:
    """One engine's mode under ``per_request: "auto"``: whether it plans per request, why,
    and the gain average that decides it."""

    engaged: bool = False
    reason: Reason = Reason.LEARNING
    gains: GainAverage = dataclasses.field(default_factory=GainAverage)
    checks: int = 0
    switches: int = 0

    def check(self, gain: float, params: ModeParams) -> None:
        """Add one check's gain and move between the modes where its bounds say so."""
        self.checks += 1
        self.gains.add(gain, 1.0 - 1.0 / params.window_checks)
        low, high = self.gains.bounds(params.sure_z)
        if self.checks < params.min_checks:
            self.reason = Reason.LEARNING
            return
        if not self.engaged and low > params.gain_on:
            self.engaged, self.switches = True, self.switches + 1
        elif self.engaged and high < params.gain_off:
            self.engaged, self.switches = False, self.switches + 1
        self.reason = Reason.GAIN_ABOVE_MARGIN if self.engaged else Reason.GAIN_BELOW_MARGIN

    def to_json(self) -> dict[str, Any]:
        return {
            "engaged": self.engaged,
            "reason": self.reason.value,
            "gain": [self.gains.weight, self.gains.mean, self.gains.spread],
            "checks": self.checks,
            "switches": self.switches,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RequestMode:
        weight, mean, spread = (float(v) for v in data["gain"])
        if not all(math.isfinite(v) for v in (weight, mean, spread)) or weight < 0:
            raise ValueError("a request mode's gain must be finite, its weight >= 0")
        checks, switches = int(data["checks"]), int(data["switches"])
        if checks < 0 or switches < 0:
            raise ValueError("a request mode's counts must be >= 0")
        return cls(
            bool(data["engaged"]),
            Reason(data["reason"]),
            GainAverage(weight, mean, spread),
            checks,
            switches,
        )


def sure_alphas(
    records: Sequence[RequestRecord | None], pooled: float, prior_weight: float, z: float
) -> list[float]:
    """Each request's α shrunk to ``pooled`` (per_request.shrunk_alpha), then moved ``z``
    standard errors of that estimate further towards it (no further than it): how far
    apart the requests are that their counts make sure of. A request never observed is at
    the pooled α."""
    out: list[float] = []
    for record in records:
        if record is None:
            out.append(pooled)
            continue
        weight = record.successes + record.failures + prior_weight
        alpha = (record.successes + prior_weight * pooled) / weight
        error = z * math.sqrt(alpha * (1.0 - alpha) / (weight + 1.0))
        distance = alpha - pooled
        out.append(pooled + math.copysign(max(abs(distance) - error, 0.0), distance))
    return out
