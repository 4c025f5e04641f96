"""Policy registry: every selectable γ policy, by name."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nightjar_common.json_input import JsonError, load_json
from policy_server.policies.base import (
    LearnedState,
    Policy,
    PolicyError,
    TentativeDecisions,
    learned_state,
    tentative_decisions,
)
from policy_server.policies.dsd import DsdParams, DsdPolicy
from policy_server.policies.dsde import DsdeParams, DsdePolicy
from policy_server.policies.ema import EmaParams, EmaPolicy
from policy_server.policies.fixed import (
    OffParams,
    OffPolicy,
    RandomParams,
    RandomPolicy,
    StaticParams,
    StaticPolicy,
    TableParams,
    TablePolicy,
)
from policy_server.policies.goodput import GoodputModelPolicy, GoodputParams
from policy_server.policies.nightjar import NightjarParams, NightjarPolicy
from policy_server.policies.ucb import UcbParams, UcbPolicy

__all__ = [
    "DEFAULT_POLICY",
    "REGISTRY",
    "LearnedState",
    "Policy",
    "PolicyError",
    "PolicySpec",
    "TentativeDecisions",
    "UnknownPolicyError",
    "create_policy",
    "learned_state",
    "tentative_decisions",
]


class UnknownPolicyError(KeyError):
    """No policy is registered under that name."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True, slots=True)
class PolicySpec:
    name: str
    description: str
    # Every registered policy is served: it has the learned-state protocol too.
    factory: Callable[[Mapping[str, Any] | None], Policy]
    params_type: type[Any]

    def default_params(self) -> dict[str, Any]:
        return dataclasses.asdict(self.params_type())


REGISTRY: dict[str, PolicySpec] = {
    spec.name: spec
    for spec in (
        PolicySpec(
            "nightjar",
            "Per-batch-size bin-greedy bandit with switching cost "
            "(Nightjar, Li et al., arXiv:2512.22420).",
            NightjarPolicy,
            NightjarParams,
        ),
        PolicySpec(
            "goodput",
            "Thompson sampling on a learned goodput model: one acceptance rate and one "
            "step-time regression pooled over all batch sizes; optional TPOT SLO.",
            GoodputModelPolicy,
            GoodputParams,
        ),
        PolicySpec(
            "static",
            "Fixed γ = k for every step (stock speculative decoding).",
            StaticPolicy,
            StaticParams,
        ),
        PolicySpec("off", "γ = 0: no speculation (plain decoding baseline).", OffPolicy, OffParams),
        PolicySpec(
            "table",
            "Batch size → γ table shaped like vLLM's dynamic-SD schedule (PR #32374).",
            TablePolicy,
            TableParams,
        ),
        PolicySpec(
            "random",
            "γ uniform in 0..gamma_max per step, seeded: a losslessness canary.",
            RandomPolicy,
            RandomParams,
        ),
        PolicySpec(
            "ema",
            "SGLang-style EMA of accepted length per batch-size tier, with hysteresis.",
            EmaPolicy,
            EmaParams,
        ),
        PolicySpec(
            "dsd",
            "SmartSpec/DSD: argmax goodput under an offline-fitted linear latency model, "
            "α from the engine's counters.",
            DsdPolicy,
            DsdParams,
        ),
        PolicySpec(
            "dsde",
            "DSDE: a γ per request from the weighted variance of its recent draft/target KL "
            "divergence (WVIR), the batch capped at their mean.",
            DsdePolicy,
            DsdeParams,
        ),
        PolicySpec(
            "ucb",
            "BanditSpec-style UCB over γ, one arm set per power-of-two batch bucket.",
            UcbPolicy,
            UcbParams,
        ),
    )
}


# What `nightjar-server` runs without --policy: the winner of the benchmark matrix
# (docs/BENCHMARKS.md); `nightjar` stays selectable as the paper's Algorithm 1.
DEFAULT_POLICY = "goodput"


def create_policy(name: str, params: Mapping[str, Any] | None = None) -> Policy:
    """Instantiate a registered policy; UnknownPolicyError / PolicyError on bad input."""
    spec = REGISTRY.get(name)
    if spec is None:
        raise UnknownPolicyError(
            f"unknown policy '{name}'; registered: {', '.join(sorted(REGISTRY))}"
        )
    return spec.factory(params)


def parse_params_json(text: str) -> dict[str, Any]:
    """Parse a params JSON object ("" = {}); PolicyError when it is not one."""
    if not text.strip():
        return {}
    try:
        value = load_json(text)
    except JsonError as exc:
        raise PolicyError(f"params are not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise PolicyError("params must be a JSON object")
    return value
